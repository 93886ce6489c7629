from __future__ import annotations

import json
import re

import pytest
import torch
from pdfs import BODY, make_pdf
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.defaults import DEFAULT_POLICY

runner = CliRunner()
FAST = ["-n", "8", "--steps", "8", "--block-length", "8"]


@pytest.fixture
def pdf(tmp_path):
    path = tmp_path / "story.pdf"
    path.write_bytes(make_pdf(BODY))
    return path


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code, *fragments):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ")
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in lines[-1], (f, lines[-1])


def test_ingest_json_list_remove(pdf):
    result = run("ingest", pdf, "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["documents"][0]
    assert row["pages"] == 5 and row["cached"] is False and row["tokens"] > 0
    again = json.loads(run("ingest", pdf, "--json").stdout)["documents"][0]
    assert again["cached"] is True and again["sha256"] == row["sha256"]
    listed = json.loads(run("ingest", "--list", "--json").stdout)["documents"]
    assert [d["sha256"] for d in listed] == [row["sha256"]]
    empty = run("ingest", "--remove", "")
    assert empty.exit_code == 2 and empty.stderr.startswith("error: --remove is empty; give a stored document's")
    assert run("ingest", "--remove", "story.pdf").exit_code == 0
    assert json.loads(run("ingest", "--list", "--json").stdout)["documents"] == []


def test_ingest_with_model_tokenizer(pdf, tiny_dir):
    row = json.loads(run("ingest", pdf, "--model", tiny_dir, "--json").stdout)["documents"][0]
    assert row["token_method"] == "model tokenizer"


def test_ask_answers_and_json(pdf, tiny_dir):
    result = run("ask", pdf, "What does the keeper write?", "--model", tiny_dir, *FAST)
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.stderr
    result = run("ask", pdf, "--model", tiny_dir, "-q", "Who?", "-q", "When?", "--json", *FAST)
    data = json.loads(result.stdout)
    assert data["document"]["pages"] == 5
    assert [a["question"] for a in data["answers"]] == ["Who?", "When?"]
    assert all(a["policy"] == DEFAULT_POLICY and a["stats"]["prompt_len"] > 50 for a in data["answers"])


def test_ask_questions_file_and_policy(pdf, tiny_dir, tmp_path):
    qfile = tmp_path / "q.txt"
    qfile.write_text("# comment\nWhere?\n\nWhy?\n")
    data = json.loads(run("ask", pdf, "--model", tiny_dir, "--questions", qfile, "--policy", "snapkv",
                          "--budget", "16", "--json", *FAST).stdout)
    assert [a["question"] for a in data["answers"]] == ["Where?", "Why?"]
    assert all(a["budget"] == 16 and a["stats"]["kv_bytes"] < a["stats"]["kv_full_bytes"] for a in data["answers"])


def test_a_long_document_is_read_in_parts_by_default(tiny_dir, tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text(("The river runs past the mill. " * 40 + "\n\n") * 30)
    result = run("ask", doc, "Where does the river run?", "--model", tiny_dir, *FAST)
    assert result.exit_code == 0, result.output
    assert "read in" in result.stderr and "parts of up to" in result.stderr and "dropped" not in result.stderr
    answer = json.loads(run("ask", doc, "Where?", "--model", tiny_dir, "--json", *FAST).stdout)["answers"][0]
    read = answer["read"]
    assert read["mode"] == "parts" and read["complete"] is True and read["pages_not_read"] == []
    assert read["parts"] == len(answer["parts"]) > 1 and answer["dropped_tokens"] == 0
    assert read["pages"] == list(range(1, read["pages_total"] + 1))
    assert answer["source"]["pages"] and set(answer["source"]["pages"]) <= set(read["pages"])


def test_a_cut_document_says_so_on_the_answer_line(tiny_dir, tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text(("The river runs past the mill. " * 40 + "\n\n") * 30)
    result = run("ask", doc, "Where does the river run?", "--model", tiny_dir, "--long", "truncate", *FAST)
    assert result.exit_code == 0, result.output
    assert "dropped" in result.stderr and "from the middle" in result.stderr
    (line,) = result.stdout.splitlines()
    assert "[read pages 1" in line
    assert line.endswith("were cut (--long truncate; the default --long parts reads them all)]")
    data = json.loads(run("ask", doc, "Where?", "--model", tiny_dir, "--json", "--long", "truncate", *FAST).stdout)
    answer = data["answers"][0]
    assert answer["dropped_tokens"] > 0 and answer["prompt_tokens"] <= 1024
    assert answer["read"]["complete"] is False and answer["read"]["pages_not_read"]
    assert answer["read"]["pages"][0] == 1 and answer["read"]["pages"][-1] == data["document"]["pages"]
    scaled = json.loads(run("ask", doc, "Where?", "--model", tiny_dir, "--json", "--long", "rope-scale", *FAST).stdout)
    assert scaled["answers"][0]["dropped_tokens"] == 0 and scaled["answers"][0]["rope_factor"] > 1
    assert scaled["answers"][0]["read"]["complete"] is True


def test_summarize_parts(pdf, tiny_dir):
    result = run("summarize", pdf, "--model", tiny_dir, "--length", "5", "--json", "--steps", "8",
                 "--block-length", "8")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["pages"] == 5 and len(data["parts"]) >= 1 and isinstance(data["summary"], str)


def test_summarize_uses_a_lead_summary_models_trained_format(pdf, tiny_dir, tmp_path, monkeypatch):
    """A model whose generation_config.json declares ``summary_length`` (the embedded one) gets exactly the prompt
    it was trained on: ``part_instruction`` for every part and for the merge, ``summary_length`` tokens in one
    block; another model keeps the length from --length and the merge instruction."""
    import shutil

    import maskkv_cli.app.pipeline as pipeline
    from maskkv_cli.prompting.parts import merge_instruction, part_instruction

    lead = tmp_path / "lead-model"
    shutil.copytree(tiny_dir, lead)
    gen_file = lead / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen["maskkv"] = {"gen_length": 8, "steps": 8, "block_length": 8, "summary_length": 16}
    gen_file.write_text(json.dumps(gen))
    seen = []
    real = pipeline.ask

    def spy(session, context, question, gen, cache, **hooks):
        seen.append((question, gen.gen_length, gen.block_length))
        return real(session, context, question, gen, cache, **hooks)

    monkeypatch.setattr(pipeline, "ask", spy)
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("\n\n".join(f"Paragraph {i} says something about the harbour. " * 40 for i in range(30)))
    result = run("summarize", long_doc, "--model", lead, "--length", "50", "--json")
    assert result.exit_code == 0, result.output
    assert len(seen) >= 3  # several parts, then the merge
    assert all(s == (part_instruction(50), 16, 16) for s in seen)
    seen.clear()
    gen["maskkv"]["summary_block_length"] = 4  # trained for block decoding (train-tiny --summary-block 4)
    gen_file.write_text(json.dumps(gen))
    result = run("summarize", long_doc, "--model", lead, "--length", "50", "--json")
    assert result.exit_code == 0, result.output
    assert seen and all(s == (part_instruction(50), 16, 4) for s in seen)
    seen.clear()
    result = run("summarize", long_doc, "--model", tiny_dir, "--length", "50", "--json", "--steps", "3")
    assert result.exit_code == 0, result.output
    assert seen[0] == (part_instruction(50), 96, 32) and seen[-1][0] == merge_instruction(50)


def test_encrypted_pdf(tmp_path, tiny_dir):
    path = tmp_path / "secret.pdf"
    path.write_bytes(make_pdf(BODY[:2], password="s3cret"))
    one_line_error(run("ask", path, "Who?", "--model", tiny_dir, *FAST), 1, "--password")
    ok = run("ask", path, "Who?", "--model", tiny_dir, "--password", "s3cret", *FAST)
    assert ok.exit_code == 0, ok.output


def test_pdf_without_text_and_truncated(tmp_path, tiny_dir):
    scan = tmp_path / "scan.pdf"
    scan.write_bytes(make_pdf([None, None]))
    one_line_error(run("ask", scan, "Who?", "--model", tiny_dir), 1, "scanned", "pages 1-2")
    data = make_pdf(BODY)
    cut = tmp_path / "cut.pdf"
    cut.write_bytes(data[: data.index(b"(Fourth, the storm")])
    result = run("ask", cut, "Who?", "--model", tiny_dir, *FAST)
    assert result.exit_code == 0, result.output
    assert "truncated or damaged" in result.stderr


@pytest.mark.parametrize(
    "name,content,fragment",
    [
        ("missing.txt", None, "not found"),
        ("folder", "DIR", "directory"),
        ("report.docx", b"PK\x03\x04 not really", ".docx"),
        ("empty.txt", b"", "empty"),
        ("junk.txt", bytes(range(256)) * 20, "binary"),
    ],
)
def test_bad_documents(tmp_path, tiny_dir, name, content, fragment):
    path = tmp_path / name
    if content == "DIR":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    one_line_error(run("ask", path, "Who?", "--model", tiny_dir), 1, fragment)


def test_undecodable_text(tmp_path, tiny_dir):
    path = tmp_path / "odd.txt"
    path.write_bytes(bytes([0x81, 0x8D, 0x8F, 0x90, 0x9D]) * 50)
    result = run("ask", path, "Who?", "--model", tiny_dir)
    assert result.exit_code == 1 and result.stderr.startswith("error: ")


def test_bad_questions_and_budgets(pdf, tiny_dir):
    one_line_error(run("ask", pdf, "   ", "--model", tiny_dir), 2, "question is empty")
    one_line_error(run("ask", pdf, "--model", tiny_dir), 2, "no question")
    one_line_error(run("ask", pdf, "Who?", "--model", tiny_dir, "--budget", "0"), 2, "--budget")
    one_line_error(run("ask", pdf, "Who?", "--model", tiny_dir, "--ratio", "1.5"), 2, "--ratio")
    one_line_error(run("ask", pdf, "Who?", "--model", tiny_dir, "--ratio", "0"), 2, "--ratio")


def test_model_folder_missing_files(pdf, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    one_line_error(run("ask", pdf, "Who?", "--model", folder), 1, "no config.json")


def test_interrupt_exits_130_and_keeps_store(pdf, tiny_dir, monkeypatch):
    from maskkv_cli.app.session import Session
    from maskkv_cli.documents.store import DocumentStore

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "answer_ids", boom)
    result = run("ask", pdf, "Who?", "--model", tiny_dir)
    assert result.exit_code == 130 and "interrupted" in result.stderr
    entries = DocumentStore().list()
    assert len(entries) == 1 and DocumentStore().get(entries[0].sha256) is not None
    assert not [p for p in DocumentStore().root.rglob("*") if p.name.startswith(".")]


def test_out_of_memory_message(pdf, tiny_dir, monkeypatch):
    from maskkv_cli.app.session import Session

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Session, "answer_ids", oom)
    one_line_error(run("ask", pdf, "Who?", "--model", tiny_dir), 1, "ran out of memory", "--budget", "--device cpu")


def test_layer_budget_modes_and_calibration_note(pdf, tiny_dir):
    base = ["ask", pdf, "Who?", "--model", tiny_dir, "--budget", "8", *FAST]
    result = run(*base)
    assert result.exit_code == 0, result.output
    assert "no calibration profile" in result.stderr
    assert run("calibrate", "--model", tiny_dir, pdf, "--quiet").exit_code == 0
    result = run(*base)
    assert "using calibration profile" in result.stderr
    data = json.loads(run(*base, "--layer-budgets", "online", "--json").stdout)
    assert data["answers"][0]["stats"]["kv_bytes"] < data["answers"][0]["stats"]["kv_full_bytes"]
    one_line_error(run(*base, "--layer-budgets", "sometimes"), 2, "--layer-budgets")


@pytest.mark.parametrize("command", [["ask", "{pdf}", "What?"], ["summarize", "{pdf}"], ["profile", "{pdf}"]])
def test_live_panel_and_session_resolve_auto_to_the_same_device(pdf, tiny_dir, monkeypatch, command):
    # With a GPU visible, --device auto must give the live panel the device the session runs on (it showed the
    # CPU's memory while the model ran on CUDA). The session stops right away: no GPU is needed.
    from maskkv_cli.app.session import Session
    from maskkv_cli.cli import render
    from maskkv_cli.errors import MaskKVError

    seen: dict[str, str] = {}
    panel_init = render.LiveRun.__init__

    def panel(self, console, enabled, device="cpu"):
        seen["panel"] = device
        panel_init(self, console, enabled, device)

    def session(self, path, device="cpu", **kwargs):
        seen["session"] = device
        raise MaskKVError("stop here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(render.LiveRun, "__init__", panel)
    monkeypatch.setattr(Session, "__init__", session)
    result = run(*[a.format(pdf=pdf) for a in command], "--model", tiny_dir)
    one_line_error(result, 1, "stop here")
    assert seen == {"panel": "cuda", "session": "cuda"}


def test_resolve_device(monkeypatch):
    from maskkv_cli.runtime.devices import resolve_device

    assert resolve_device("cpu") == "cpu"
    for available, want in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert resolve_device("auto") == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"


@pytest.mark.parametrize(("name", "gpus", "message"), [
    ("gpu", 0, "unknown device 'gpu'; use auto, cpu, cuda, cuda:N or mps"),
    ("cuda", 0, "finds no CUDA GPU on this machine; use cpu or auto"),
    ("cuda:2", 2, "device cuda:2: this machine has 2 CUDA GPUs (cuda:0 to cuda:1)"),
    ("meta", 0, "device meta: maskkv runs on cpu, cuda or mps"),
])
def test_a_device_this_machine_lacks_is_a_one_line_error_before_loading(monkeypatch, tmp_path, tiny_dir, name, gpus,
                                                                        message):
    # Before, --device cuda on a machine without CUDA failed inside loading with PyTorch's pin_memory message.
    from maskkv_cli.errors import UsageError
    from maskkv_cli.runtime.devices import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(UsageError, match=re.escape(message)):
        check_device(name)
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number for apple is 4366.\n")
    result = run("ask", str(doc), "What?", "--model", tiny_dir, "--device", name)
    one_line_error(result, 2, message)


def test_the_live_panel_s_elapsed_time_runs_through_a_silent_phase():
    """The panel was drawn from a table rendered at the last event: through a long phase without events (cutting a
    book into parts: minutes) it showed the same elapsed time, as if hung."""
    import io
    import re
    import time

    from rich.console import Console

    from maskkv_cli.cli.render import LiveRun

    out = io.StringIO()
    with LiveRun(Console(file=out, force_terminal=True, width=80), enabled=True) as live:
        live.phase("tokenize", "question 1/1")
        time.sleep(1.0)  # no event at all
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's codes out
    shown = set(re.findall(r"elapsed\s+(\d+\.\d) s", frames))
    assert len(shown) >= 2, shown
