"""``maskkv pull`` against a real HTTP server on 127.0.0.1 in the Hub's layout (tests/hubserver.py), through the
real huggingface_hub: nothing of it is mocked."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hubserver import COMMIT, FakeHub
from prompts import NEEDLE_DOC
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.models import hub
from maskkv_cli.models.catalog import shipped_model
from maskkv_cli.models.hub import HubError, PullEvent, pull
from maskkv_cli.models.loading import load_model
from maskkv_cli.paths import resolve_model_path

REPO = "GSAI-ML/LLaDA-8B-Instruct"
runner = CliRunner()


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """The embedded checkpoint plus files a real repository has and a pull must skip."""
    folder = tmp_path / "upstream"
    shutil.copytree(shipped_model(), folder)
    (folder / "modeling_llada.py").write_text("raise SystemExit('remote code must never be fetched')\n")
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    (folder / "README.md").write_text("# a model card\n")
    return folder


@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """An empty HF home and cache of this test's own; no token, online."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hf" / "hub"


def point_hub_at(endpoint: str, home: Path, monkeypatch) -> None:
    """HF_ENDPOINT for our code; the same for the few settings huggingface_hub reads once at import (the endpoint
    of its own side requests, its token file, offline flag), so that nothing reaches the real Hub or home."""
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(hc, "ENDPOINT", endpoint)
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(hc, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)


@pytest.fixture
def server(checkpoint, hf_env, monkeypatch):
    with FakeHub({REPO: checkpoint, "gated-org/tiny": checkpoint}, gated={"gated-org/tiny": "hf_right"}) as fake:
        point_hub_at(fake.endpoint, hf_env.parent, monkeypatch)
        yield fake


def test_pull_fetches_only_what_the_loader_reads(server, hf_env):
    events: list[PullEvent] = []
    result = pull(REPO, on_event=events.append)
    repo = hf_env / f"models--{REPO.replace('/', '--')}"
    assert result.commit == COMMIT and result.path == repo / "snapshots" / COMMIT
    names = sorted(p.name for p in result.path.iterdir())
    assert names == sorted(["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                            "tokenizer.json", "tokenizer_config.json"])
    fetched = [r["path"] for r in server.downloads()]
    assert not any(p.endswith((".py", ".bin", ".md")) for p in fetched)
    # the weights come from the CDN with the size the HEAD announced; the bar saw every byte
    assert any(r["server"] == "cdn" for r in server.downloads())
    size = sum(f.size for f in result.files)
    assert result.fetched_bytes == size == sum(e.n for e in events if e.kind == "bytes")
    assert (hf_env / f"models--{REPO.replace('/', '--')}" / "refs" / "main").read_text() == COMMIT
    # --model ORG/NAME now resolves to the pulled snapshot and loads
    assert resolve_model_path(REPO) == result.path
    load_model(REPO)


def test_second_pull_downloads_nothing(server):
    pull(REPO)
    before = len(server.requests())
    again = pull(REPO)
    after = server.requests()[before:]
    assert again.fetched_bytes == 0
    assert [(r["method"], r["path"].split("?")[0]) for r in after] == [("GET", f"/api/models/{REPO}/revision/main")]


def test_dropped_connection_resumes_with_range(server, monkeypatch):
    """The server closes the connection 3.5 MB into the weights once; huggingface_hub retries with a Range header
    from the last whole chunk it wrote. Its chunks are 10 MiB, more than the tiny file: 1 MiB here."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 2**20)
    size = (shipped_model() / "model.safetensors").stat().st_size
    server.drop_once["model.safetensors"] = 3_500_000
    result = pull(REPO)
    weights = [r for r in server.requests("cdn") if r["method"] == "GET"]
    assert [r["range"] for r in weights] == [None, f"bytes={3 * 2**20}-"]
    assert (result.path / "model.safetensors").read_bytes() == (shipped_model() / "model.safetensors").read_bytes()
    assert (result.path / "model.safetensors").stat().st_size == size


def test_missing_repo(server, monkeypatch):
    with pytest.raises(HubError, match=r"no model nobody/nothing on http://127\.0\.0\.1:\d+ \(HTTP 401\).*HF_TOKEN"):
        pull("nobody/nothing")
    monkeypatch.setenv("HF_TOKEN", "hf_any")
    with pytest.raises(HubError, match=r"no model nobody/nothing on .* \(HTTP 404\)"):
        pull("nobody/nothing")


def test_missing_revision(server):
    with pytest.raises(HubError, match="has no revision 'v9'"):
        pull(REPO, revision="v9")


def test_gated_without_and_with_token(server, monkeypatch):
    with pytest.raises(HubError, match=r"gated-org/tiny is gated: accept its terms at .* set HF_TOKEN"):
        pull("gated-org/tiny")
    assert not server.downloads()  # said before any file was asked for
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match=r"gated \(HTTP 403\).*has no access"):
        pull("gated-org/tiny")
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    result = pull("gated-org/tiny")
    assert (result.path / "model.safetensors").is_file()
    hub_gets = [r for r in server.requests("hub") if "/resolve/" in r["path"]]
    assert hub_gets[-1]["authorization"] == "Bearer hf_right"
    assert all(r["authorization"] is None for r in server.requests("cdn"))  # the token never leaves the hub


def test_offline_uses_the_cache_or_says_what_to_do(server, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=f"HF_HUB_OFFLINE is set and {REPO} .* is not in the local cache"):
        pull(REPO)
    assert server.requests() == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    first = pull(REPO)
    count = len(server.requests())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = pull(REPO)
    assert again.offline and again.path == first.path and len(server.requests()) == count


def test_unreachable_endpoint(hf_env, monkeypatch):
    with FakeHub({}) as fake:
        dead = fake.endpoint
    point_hub_at(dead, hf_env.parent, monkeypatch)  # nothing listens there any more
    with pytest.raises(HubError, match="cannot reach http://127.0.0.1"):
        pull(REPO)


def test_not_enough_disk_names_the_size(server, monkeypatch):
    monkeypatch.setattr(hub, "free_bytes", lambda folder: 1_000_000)
    with pytest.raises(HubError, match=r"needs \d+\.\d MB in .*which has 1\.0 MB free") as err:
        pull(REPO)
    needed = float(re.search(r"needs (\d+\.\d) MB", str(err.value)).group(1))
    weights = (shipped_model() / "model.safetensors").stat().st_size / 1e6
    everything = sum(f.stat().st_size for f in shipped_model().iterdir()) / 1e6
    assert weights - 0.05 <= needed <= everything + 0.05  # the weights and what the loader reads beside them
    assert not any(r["server"] == "cdn" for r in server.requests())  # checked before any weight is fetched


def test_cli_pull_then_model_id_works(server, tmp_path):
    result = runner.invoke(app, ["pull", REPO])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(COMMIT)
    out = runner.invoke(app, ["pull", REPO, "--json"])
    data = json.loads(out.stdout)
    assert data["downloaded_bytes"] == 0 and data["commit"] == COMMIT
    doc = tmp_path / "doc.txt"
    doc.write_text(NEEDLE_DOC)
    asked = runner.invoke(app, ["ask", str(doc), "What is the special magic number for apple?", "--model", REPO,
                                "--json"])
    assert asked.exit_code == 0, asked.output
    assert json.loads(asked.stdout)["answers"][0]["answer"] == "4821"
    listed = json.loads(runner.invoke(app, ["models", "--json"]).stdout)["models"]
    cached = [m for m in listed if m["source"] == "hf-cache"]
    assert cached == [dict(cached[0], name=REPO, family="llada", loadable=True, dtype="float32")]


def test_cli_errors_are_one_line(server):
    result = runner.invoke(app, ["pull", "nobody/nothing"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and result.stderr.startswith("error: no model")
    result = runner.invoke(app, ["pull", "gated-org/tiny"])
    assert result.exit_code == 1 and "is gated" in result.stderr and "Traceback" not in result.output


def test_model_not_on_disk_gives_the_pull_command_or_pulls_with_yes(server, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number for apple is 4821.")
    result = runner.invoke(app, ["ask", str(doc), "What is the special magic number for apple?", "--model", REPO])
    assert result.exit_code == 1
    assert f"`maskkv pull {REPO}`" in result.stderr and "--yes" in result.stderr
    assert server.requests() == []  # nothing is downloaded without asking
    result = runner.invoke(app, ["ask", str(doc), "What is the special magic number for apple?", "--model", REPO,
                                 "--yes", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "4821"


@pytest.mark.parametrize("command", [["demo", "--length", "40"], ["calibrate", "--samples", "1", "--max-tokens",
                                                                     "64"]])
def test_every_command_whose_error_offers_yes_takes_it(server, command):
    """demo, calibrate, profile and bench quality said "(or add --yes to download it now)" and refused --yes; they
    take it now (demo and calibrate run here against the local hub: nothing is pulled without it, all with it)."""
    result = runner.invoke(app, [*command, "--model", REPO])
    assert result.exit_code == 1 and "--yes" in result.stderr and server.requests() == []
    result = runner.invoke(app, [*command, "--model", REPO, "--yes", "--quiet"])
    assert result.exit_code == 0, result.output
    for other in (["profile", "x.txt"], ["bench", "quality"]):
        assert "--yes" in runner.invoke(app, [*other, "--help"]).stdout


def test_models_lists_remembered_folders_and_why_one_does_not_load(tmp_path, tiny_dir, hf_env):
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the mill. " * 20)
    assert runner.invoke(app, ["ask", str(doc), "Where?", "--model", str(tiny_dir), "--quiet"]).exit_code == 0
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").unlink()
    assert runner.invoke(app, ["ask", str(doc), "Where?", "--model", str(broken), "--quiet"]).exit_code == 1
    listed = {m["path"]: m for m in json.loads(runner.invoke(app, ["models", "--json"]).stdout)["models"]}
    assert listed[str(tiny_dir.resolve())]["loadable"] is True and listed[str(tiny_dir.resolve())]["family"] == "llada"
    assert listed[str(broken.resolve())]["loadable"] is False
    assert "no model.safetensors" in listed[str(broken.resolve())]["problem"]
    shown = runner.invoke(app, ["models"])
    assert "no: " in shown.stdout and "llada" in shown.stdout


def test_sharded_checkpoint_fetches_the_index_and_its_shards_only(tmp_path, tiny_model, tiny_tokenizer, hf_env,
                                                                   monkeypatch):
    from maskkv_cli.models.loading import save_model

    folder = save_model(tiny_model, tmp_path / "sharded", tiny_tokenizer, max_shard_bytes=200_000)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shutil.copy(folder / shards[0], folder / "consolidated.safetensors")  # not in the index: never fetched
    with FakeHub({"org/sharded": folder}) as fake:
        point_hub_at(fake.endpoint, hf_env.parent, monkeypatch)
        result = pull("org/sharded")
    names = sorted(p.name for p in result.path.iterdir())
    assert "consolidated.safetensors" not in names
    assert set(shards) | {"model.safetensors.index.json", "config.json"} <= set(names)
    load_model(result.path)


def test_a_cached_model_is_pulled_without_the_hub_when_it_cannot_be_reached(server, hf_env, monkeypatch):
    first = pull(REPO)
    with FakeHub({}) as fake:
        dead = fake.endpoint
    point_hub_at(dead, hf_env.parent, monkeypatch)  # the network is gone; HF_HUB_OFFLINE is not set
    again = pull(REPO)
    assert again.offline and again.path == first.path and "cannot be reached" in again.note
    shown = runner.invoke(app, ["pull", REPO])
    assert shown.exit_code == 0, shown.output
    assert "cannot be reached" in shown.stderr and "using the cached copy" in shown.stderr
    with pytest.raises(HubError, match="cannot reach"):  # not cached: still an error, with what to do
        pull("other-org/other-model")


@pytest.mark.parametrize("given, expected", [
    ("GSAI-ML/LLaDA-8B-Instruct", ("GSAI-ML/LLaDA-8B-Instruct", None)),
    ("https://huggingface.co/GSAI-ML/LLaDA-8B-Instruct", ("GSAI-ML/LLaDA-8B-Instruct", None)),
    ("https://huggingface.co/GSAI-ML/LLaDA-8B-Instruct/", ("GSAI-ML/LLaDA-8B-Instruct", None)),
    ("huggingface.co/GSAI-ML/LLaDA-8B-Instruct/tree/v1.0", ("GSAI-ML/LLaDA-8B-Instruct", "v1.0")),
    ("https://hf.co/GSAI-ML/LLaDA-8B-Instruct/blob/main/config.json", ("GSAI-ML/LLaDA-8B-Instruct", "main")),
    ("https://huggingface.co/models/GSAI-ML/LLaDA-8B-Instruct", ("GSAI-ML/LLaDA-8B-Instruct", None)),
])
def test_a_model_page_address_is_read_as_its_id(given, expected):
    assert hub.parse_repo(given) == expected


@pytest.mark.parametrize("given", ["https://example.com/GSAI-ML/LLaDA-8B-Instruct",
                                   "https://huggingface.co/datasets/org/data", "https://huggingface.co/GSAI-ML"])
def test_other_addresses_are_refused_in_one_line(given):
    with pytest.raises(HubError, match="is not the address of a model on the Hugging Face Hub"):
        hub.parse_repo(given)


def test_cli_pull_takes_the_page_address(server):
    result = runner.invoke(app, ["pull", f"{server.endpoint}/{REPO}/tree/main"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(COMMIT) and f"use it with --model {REPO}" in result.stderr


def test_models_lists_a_folder_whose_config_is_no_config_and_goes_on(tmp_path, hf_env):
    """One remembered folder whose config.json held a list ended `maskkv models` with "AttributeError: 'list'
    object has no attribute 'get'" (a dtype list: Rich's NotRenderableError), no table at all."""
    import json as _json

    from maskkv_cli.models.catalog import remember_folder
    from maskkv_cli.paths import maskkv_home

    shapes = {"listed": [1, 2], "odd-dtype": {"model_type": "llada", "torch_dtype": ["x"]}}
    for name, config in shapes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(_json.dumps(config))
        remember_folder(tmp_path / name)
    shown = runner.invoke(app, ["models"])
    assert shown.exit_code == 0, shown.output
    listed = {m["path"]: m for m in json.loads(runner.invoke(app, ["models", "--json"]).stdout)["models"]}
    assert "is not a model config (a JSON object), it holds a list" in listed[str(tmp_path / "listed")]["problem"]
    assert listed[str(tmp_path / "odd-dtype")]["dtype"] is None
    (maskkv_home() / "models.json").write_text('["/x"]')  # the list of folders itself of another shape
    assert runner.invoke(app, ["models"]).exit_code == 0
