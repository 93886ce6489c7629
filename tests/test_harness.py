"""maskkv as an lm-evaluation-harness model: local tasks (LongBench records, a GSM8K-like file) with the embedded
tiny model, scored by the harness and compared with ``bench quality`` on the same records and prompts."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed; pip install -e '.[dev,eval]' runs these tests")

from typer.testing import CliRunner  # noqa: E402

from maskkv_cli.cli import app  # noqa: E402
from maskkv_cli.models.catalog import shipped_model  # noqa: E402

PROMPT = "{context}\n\n{input}"  # the tiny model's training format (document, then question), as a template
NEEDLES = [("apple", 48213), ("pear", 11920), ("plum", 55301), ("fig", 70412)]
GSM = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "7"),
       ("A train has 5 cars and 2 more are added. How many cars?", "7"),
       ("There are 9 bees and 4 fly away. How many are left?", "5")]
# fuzzywuzzy (the harness's LongBench metrics import it) warns that python-Levenshtein would be faster
pytestmark = pytest.mark.filterwarnings("ignore:Using slow pure-python SequenceMatcher")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _records() -> list[dict[str, Any]]:
    """LongBench-format records (hotpotqa): a needle among filler, some with other keys' needles as distractors."""
    filler = ["The river runs past the old mill and under the stone bridge. ",
              "Trains come twice a day. People talk about the weather, the harvest and the market. ",
              "Bees fly from flower to flower; the library opens at nine and closes at five. "]
    records = []
    for i, (key, value) in enumerate(NEEDLES):
        others = [f"The special magic number for {k} is {v}. " for k, v in NEEDLES if k != key][: i]
        body = [filler[j % 3] for j in range(4 + 6 * i)]
        body.insert(len(body) // 3, f"The special magic number for {key} is {value}. ")
        for n, other in enumerate(others):
            body.insert((n + 2) * len(body) // (len(others) + 3), other)
        question = f"What is the special magic number for {key}?"
        records.append({"input": question, "context": "".join(body), "answers": [str(value)], "length": len(body),
                        "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": f"needle-{i}"})
    return records


def _yaml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid double-quoted YAML scalar


def _task_yaml(name: str, data: Path, doc_to_text: str, target: str, max_gen_toks: int, until: list[str],
               extra: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: generate_until\ndoc_to_text: {_yaml_string(doc_to_text)}\n"
            f"doc_to_target: {_yaml_string(target)}\ngeneration_kwargs:\n  max_gen_toks: {max_gen_toks}\n"
            f"  do_sample: false\n  until: {json.dumps(until)}\n{extra}")


def write_tasks(folder: Path, gsm_until: list[str], gsm_name: str = "local_gsm") -> None:
    """The local LongBench task (scored by the harness's own LongBench metric) and the GSM8K-like task."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()), encoding="utf-8")
    (folder / "gsm.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM),
                                      encoding="utf-8")
    # The harness's LongBench metric (qa F1), imported from its longbench task folder.
    (folder / "scoring.py").write_text("from lm_eval.tasks.longbench.metrics import get_qa_f1_with_score  "
                                       "# noqa: F401\n", encoding="utf-8")
    metric = "process_results: !function scoring.get_qa_f1_with_score\nmetric_list:\n  - metric: score\n" \
             "    aggregation: mean\n    higher_is_better: true\n"
    (folder / "local_hotpotqa.yaml").write_text(_task_yaml(
        "local_hotpotqa", folder / "hotpotqa.jsonl", PROMPT.replace("{context}", "{{context}}").replace(
            "{input}", "{{input}}"), "{{answers}}", 32, [], metric), encoding="utf-8")
    exact = "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    (folder / f"{gsm_name}.yaml").write_text(_task_yaml(
        gsm_name, folder / "gsm.jsonl", "Question: {{question}}\nAnswer:", "{{answer}}", 32, gsm_until, exact),
        encoding="utf-8")


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No hub access, and the datasets cache in a temporary folder."""
    cache = tmp_path_factory.mktemp("hf-datasets")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in OFFLINE.items():
            patch.setenv(key, value)
        patch.setenv("HF_DATASETS_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    write_tasks(folder, [])
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def evaluate(lm: Any, tasks: list[str], folder: Path, chat: bool = True) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(folder), include_defaults=False)  # only the local tasks: starts faster
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, apply_chat_template=chat, log_samples=True)


def answers_by_doc(result: dict[str, Any], task: str) -> dict[int, str]:
    return {s["doc_id"]: s["filtered_resps"][0] for s in result["samples"][task]}


@pytest.fixture(scope="module")
def runs(offline: Path, tasks_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``full`` and ``maskkv`` at budget 8 over both local tasks, one model instance each."""
    from maskkv_cli.evaluation import register

    register()
    from maskkv_cli.evaluation.harness_model import MaskKVLM

    out: dict[str, Any] = {}
    for label, args in {"full": {"policy": "full"}, "maskkv8": {"policy": "maskkv", "budget": 8}}.items():
        stats = tmp_path_factory.mktemp(f"stats-{label}")
        lm = MaskKVLM(model=str(shipped_model()), block_length=32, device="cpu", stats_dir=str(stats), **args)
        result = evaluate(lm, ["local_hotpotqa", "local_gsm"], tasks_dir)
        lines = [json.loads(x) for f in stats.glob("maskkv_requests_*.jsonl") for x in f.read_text().splitlines()]
        out[label] = {"lm": lm, "result": result, "lines": lines}
    return out


def test_longbench_score_equals_bench_quality(runs: dict[str, Any], tasks_dir: Path, tmp_path: Path) -> None:
    """The harness (its own LongBench qa-F1) and ``bench quality`` (our metric) on the same records and prompt:
    the same answers, document by document, and the same score, for full and maskkv at budget 8."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"hotpotqa": PROMPT}))
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, [
        "bench", "quality", "--model", str(shipped_model()), "--tasks", str(tasks_dir / "hotpotqa.jsonl"),
        "--prompts", str(prompts), "--policies", "full,maskkv", "--budgets", "8", "--gen-length", "32", "--steps",
        "32", "--block-length", "32", "--out", str(out), "--json", "--fresh"])
    assert result.exit_code == 0, result.output
    rows = {row["policy"]: row for row in json.loads(result.output)["results"]}
    predictions = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    ids = [r["_id"] for r in _records()]
    for label, policy in (("full", "full"), ("maskkv8", "maskkv")):
        harness = runs[label]["result"]
        mine = {ids.index(p["id"]): p["prediction"] for p in predictions if p["policy"] == policy}
        assert answers_by_doc(harness, "local_hotpotqa") == mine
        score = harness["results"]["local_hotpotqa"]["score,none"]
        assert round(100 * score, 2) == pytest.approx(rows[policy]["accuracy"])
    assert rows["full"]["accuracy"] > 0  # the tiny model finds needles: the comparison is not 0 == 0


def test_official_longbench_task_equals_bench_quality_with_its_prompt(tiny_dir: Path, offline: Path,
                                                                       tmp_path: Path) -> None:
    """The harness's own ``longbench_trec`` task (official prompt, raw text, stop at a newline, its
    classification metric) on local records, against ``bench quality`` given the same prompt as ``--prompts``:
    the same answers (the harness's cut at the newline is the first line LongBench scores) and score. The
    random tiny model of the test suite writes 64 tokens of noise for these prompts, so every token is compared
    (the embedded model ends a prompt without its chat template at once: both sides would be empty)."""
    from maskkv_cli.evaluation import register

    register()
    import lm_eval.tasks.longbench as longbench
    import yaml

    from maskkv_cli.evaluation.harness_model import MaskKVLM

    official = Path(longbench.__path__[0]) / "trec.yaml"
    loader = type("TagIgnoringLoader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda *_: None)
    text = yaml.load(official.read_text(), Loader=loader)["doc_to_text"]  # a SafeLoader that skips !function tags
    records = [{**r, "dataset": "trec", "question": r["input"], "all_classes": [str(v) for _, v in NEEDLES]}
               for r in _records()]
    data = tmp_path / "trec.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp_path / "local_trec.yaml").write_text(f"include: {official}\ntask: local_trec\ntag: []\n"
                                              f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n"
                                              f"  data_files:\n    test: {data}\n", encoding="utf-8")
    lm = MaskKVLM(model=str(tiny_dir), block_length=32, device="cpu", policy="full")
    harness = evaluate(lm, ["local_trec"], tmp_path, chat=False)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"trec": text.replace("{{context}}", "{context}").replace("{{question}}",
                                                                                           "{input}")}))
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, [
        "bench", "quality", "--model", str(tiny_dir), "--tasks", str(data), "--prompts", str(prompts),
        "--policies", "full", "--gen-length", "64", "--steps", "64", "--block-length", "32", "--out", str(out),
        "--json", "--fresh"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)["results"][0]
    ids = [r["_id"] for r in records]
    mine = {ids.index(p["id"]): p["prediction"].split("\n")[0]
            for p in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    # Both sides generate the harness's 64 tokens in blocks of 32, so the answers match token for token.
    assert all(mine.values()), mine
    assert answers_by_doc(harness, "local_trec") == mine
    assert round(100 * harness["results"]["local_trec"]["score,none"], 2) == pytest.approx(row["accuracy"])


def test_policy_and_budget_reach_the_engine(runs: dict[str, Any]) -> None:
    full = {(x["task"], x["doc_id"]): x for x in runs["full"]["lines"]}
    kept = {(x["task"], x["doc_id"]): x for x in runs["maskkv8"]["lines"]}
    assert full.keys() == kept.keys() and len(full) == len(_records()) + len(GSM)
    for key, line in kept.items():
        assert line["policy"] == "maskkv" and line["budget"] == 8
        assert line["kv_bytes"] < full[key]["kv_bytes"]
        assert full[key]["kv_bytes"] == full[key]["kv_full_bytes"] and full[key]["budget"] is None
    summary = runs["maskkv8"]["lm"].last_summary
    assert set(summary) == {"local_hotpotqa", "local_gsm"}
    assert all(row["mean_compression"] > 1.5 and row["tokens_per_s"] > 0 for row in summary.values())
    assert all(row["mean_compression"] == 1.0 for row in runs["full"]["lm"].last_summary.values())


def test_stop_strings_cut_the_output(runs: dict[str, Any], offline: Path, tmp_path: Path) -> None:
    """A stop string taken from inside an unstopped answer: the harness's answer ends right before it."""
    lm = runs["full"]["lm"]
    open_answers = answers_by_doc(runs["full"]["result"], "local_gsm")
    # the first answer with a second distinct character to stop at
    first, stop = next(((a, c) for _, a in sorted(open_answers.items()) for c in a[1:] if c != a[0] and c.strip()),
                       ("", None))
    assert stop is not None, f"no unstopped answer has a second distinct character to stop at: {open_answers}"
    write_tasks(tmp_path, [stop], gsm_name="local_gsm_stop")
    stopped = answers_by_doc(evaluate(lm, ["local_gsm_stop"], tmp_path), "local_gsm_stop")
    assert stopped == {doc: text.split(stop)[0] for doc, text in open_answers.items()}
    assert any(len(stopped[d]) < len(a) for d, a in open_answers.items() if a == first)


def test_loglikelihood_monte_carlo(runs: dict[str, Any]) -> None:
    """The estimate ranks the needle's number above a wrong one, is reproducible, and is at most 0."""
    from lm_eval.api.instance import Instance

    lm = runs["full"]["lm"]
    record = _records()[1]  # 266 tokens with its template: the embedded model trains on 128-1024 (record 0 has 123)
    context = lm.apply_chat_template([{"role": "user", "content": PROMPT.format(**record)}])

    def request(continuation: str) -> Instance:
        return Instance("loglikelihood", {}, (context, continuation), 0)

    right, wrong = lm.loglikelihood([request(record["answers"][0]), request("99999")])
    assert right[0] > wrong[0] and right[0] <= 0.0
    assert lm.loglikelihood([request(record["answers"][0])])[0] == right


def test_rolling_loglikelihood_is_refused_in_one_line(runs: dict[str, Any]) -> None:
    from maskkv_cli.errors import UsageError

    with pytest.raises(UsageError, match="generate_until and loglikelihood"):
        runs["full"]["lm"].loglikelihood_rolling([])


def test_eval_command_writes_results_and_stats(offline: Path, tasks_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["eval", "--model", str(shipped_model()), "--tasks", "local_gsm",
                                      "--include-path", str(tasks_dir), "--no-builtin-tasks", "--policy", "maskkv",
                                      "--budget", "8", "--block-length", "32", "--device", "cpu", "-o", str(out),
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "exact_match,none" in data["results"]["local_gsm"]
    assert data["maskkv"]["local_gsm"]["requests"] == len(GSM) and data["maskkv"]["local_gsm"]["budget"] == 8
    folder = Path(data["output"])
    assert list(folder.glob("samples_local_gsm_*.jsonl")) and list(folder.glob("results_*.json"))
    assert len(next(folder.glob("maskkv_requests_*.jsonl")).read_text().splitlines()) == len(GSM)


def test_an_unknown_task_is_refused_before_the_model_loads(offline: Path, tasks_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import maskkv_cli.evaluation.harness_model as harness_model

    def loading(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(harness_model, "MaskKVLM", loading)
    result = CliRunner().invoke(app, ["eval", "--model", str(shipped_model()), "--tasks", "local_gsm,nope",
                                      "--include-path", str(tasks_dir), "--no-builtin-tasks"])
    assert result.exit_code == 2, result.output
    # --no-builtin-tasks: only the include path was searched (it said "not among the harness's tasks or in ...")
    assert (f"unknown task(s) nope: not in {tasks_dir} (--no-builtin-tasks left the harness's own tasks out)"
            in result.stderr), result.stderr


def test_eval_refuses_bad_numbers_and_an_output_file_before_it_runs(tmp_path: Path,
                                                                     eval_model_args: list[dict]) -> None:
    """--mc-samples 0 divided by zero and -1 tied every choice (acc 0.5 on a 2-choice task), --limit 0 or -1 gave
    the harness's own traceback, and -o naming a file failed only after the whole evaluation; each is now one line
    before anything runs. --quiet also quiets maskkv's own progress bar (a model arg of the harness model)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args, message in ((["--mc-samples", "0"], "--mc-samples must be at least 1"),
                          (["--mc-samples", "-1"], "--mc-samples must be at least 1"),
                          (["--limit", "0"], "--limit must be a count"), (["--limit", "-1"], "--limit must be"),
                          (["--batch-size", "0"], "--batch-size must be a positive number or auto, got '0'"),
                          (["-o", str(afile)], "is a file, not a folder")):
        result = CliRunner().invoke(app, ["eval", "--tasks", "x", *args])
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
    assert eval_model_args == []
    assert CliRunner().invoke(app, ["eval", "--tasks", "x", "--quiet"]).exit_code == 0
    assert CliRunner().invoke(app, ["eval", "--tasks", "x"]).exit_code == 0
    assert [args["progress"] for args in eval_model_args] == [False, True]


def test_eval_without_the_harness_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import maskkv_cli.evaluation as evaluation

    monkeypatch.setattr(evaluation, "harness_available", lambda: False)
    result = CliRunner().invoke(app, ["eval", "--tasks", "gsm8k"])
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: the evaluation harness is not installed; run: pip install 'maskkv[eval]'"


def test_accelerate_two_processes_split_and_match(runs: dict[str, Any], offline: Path, tasks_dir: Path,
                                                  tmp_path: Path) -> None:
    """``accelerate launch`` with two CPU processes (``maskkv eval``): each rank answers its share of the
    documents, and the merged result is the one-process result."""
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert launcher, "accelerate is part of maskkv[eval]"
    out = tmp_path / "out"
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(offline)}
    command = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
               "-m", "maskkv_cli", "eval", "--model", str(shipped_model()), "--tasks", "local_hotpotqa",
               "--include-path", str(tasks_dir), "--no-builtin-tasks", "--chat-template", "--policy", "maskkv",
               "--budget", "8", "--block-length", "32", "--device", "cpu", "-o", str(out), "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])  # rank 0 prints; rank 1 prints nothing
    folder = Path(data["output"])
    lines = [json.loads(x) for x in next(folder.glob("maskkv_requests_*.jsonl")).read_text().splitlines()]
    ranks = {x["doc_id"]: x["rank"] for x in lines}
    assert ranks == {doc: doc % 2 for doc in range(len(_records()))}  # the harness's rank::world_size split
    samples = [json.loads(x) for x in next(folder.glob("samples_local_hotpotqa_*.jsonl")).read_text().splitlines()]
    one = runs["maskkv8"]["result"]
    assert {s["doc_id"]: s["filtered_resps"][0] for s in samples} == answers_by_doc(one, "local_hotpotqa")
    assert data["results"]["local_hotpotqa"]["score,none"] == one["results"]["local_hotpotqa"]["score,none"]
    assert "maskkv local_hotpotqa: 4 requests" in done.stderr


def test_a_finished_distributed_run_destroys_its_process_group(tmp_path: Path) -> None:
    """After the last collective each rank destroys the process group ``accelerate launch`` started (left to the
    interpreter's exit, gloo's threads can abort the rank); with none started, nothing happens."""
    import torch.distributed as dist

    from maskkv_cli.evaluation.harness_model import finish_distributed

    finish_distributed()  # no process group: a no-op
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        finish_distributed()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_dream_family(tiny_tokenizer: Any, tmp_path: Path) -> None:
    """A Dream checkpoint through the harness model: its own sampler's answer under the policy, the stop string
    applied, fewer bytes kept than the full cache, and a log-likelihood estimate."""
    from lm_eval.api.instance import Instance

    from maskkv_cli.app.session import Session
    from maskkv_cli.engine.plan import CacheConfig
    from maskkv_cli.errors import UsageError
    from maskkv_cli.evaluation import register
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.dream import Dream
    from maskkv_cli.models.loading import save_model
    from maskkv_cli.policies.base import PolicyOptions
    from maskkv_cli.sampling.llada import GenerationConfig

    register()
    from maskkv_cli.evaluation.harness_model import MaskKVLM

    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    folder = save_model(Dream(cfg).init_weights(seed=2, std=0.2).eval(), tmp_path / "dream", tiny_tokenizer)
    context = "The river runs past the old mill. The special magic number for apple is 48213. " * 3
    ids = [cfg.bos_token_id] + list(tiny_tokenizer.encode(context, add_special_tokens=False))
    session = Session(str(folder))
    expected = session.answer_ids(ids, GenerationConfig(gen_length=16, steps=16, block_length=8),
                                  CacheConfig("maskkv", 4, options=PolicyOptions(seed=0))).text
    assert len(expected) > 1, "the random Dream answers with at least two characters"
    stop = expected[1]
    kept: dict[str, int] = {}
    for policy, budget in (("maskkv", 4), ("full", None)):
        lm = MaskKVLM(model=str(folder), policy=policy, budget=budget, device="cpu")
        requests = [Instance("generate_until", {}, (context, {"max_gen_toks": 16, "until": []}), 0),
                    Instance("generate_until", {}, (context, {"max_gen_toks": 16, "until": [stop]}), 0)]
        for request in requests:
            request.task_name, request.doc_id = "dream", 0
        answers = lm.generate_until(requests)
        if policy == "maskkv":
            assert answers == [expected, expected.split(stop)[0]]
        kept[policy] = lm.last_summary["dream"]["mean_kv_bytes"]
    assert kept["maskkv"] < kept["full"]
    (value, _), = lm.loglikelihood([Instance("loglikelihood", {}, (context, " 48213"), 0)])
    assert value < 0.0
    with pytest.raises(UsageError, match="^--block-length is not an option of the dream sampler"):
        MaskKVLM(model=str(folder), block_length=8, device="cpu")  # LLaDA's blocks: Dream's loop has none
