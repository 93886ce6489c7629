"""The harness model's ``generate_until`` in batches: requests of one answer length and temperature are denoised
together, and every answer, report line and the order are those of one request at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prompts import TEXTS

pytest.importorskip("lm_eval", reason="lm_eval is not installed; pip install -e '.[dev,eval]' runs these tests")

from lm_eval.api.instance import Instance  # noqa: E402

import maskkv_cli.sampling.driver as driver  # noqa: E402
from maskkv_cli.errors import UsageError  # noqa: E402
from maskkv_cli.evaluation import engine_adapter, register  # noqa: E402
from maskkv_cli.evaluation.engine_adapter import request_generation  # noqa: E402

register()
from maskkv_cli.evaluation.harness_model import MaskKVLM  # noqa: E402

TIMING = {"prefill_s", "median_step_s", "total_s"}  # the machine's, different on every run
GREEDY_16 = {"max_gen_toks": 16, "until": []}
SAMPLED_8 = {"max_gen_toks": 8, "do_sample": True, "temperature": 0.8, "until": []}
# (first text, texts, question, generation settings): prompts of different lengths, the two settings interleaved
ASKED = [(0, 3, "What is the special magic number for apple?", GREEDY_16),
         (1, 1, "Where?", SAMPLED_8),
         (2, 4, "When do trains come?", GREEDY_16),
         (0, 2, "What opens at nine?", {**GREEDY_16, "until": ["m"]}),
         (3, 5, "Why?", SAMPLED_8),
         (1, 2, "x", GREEDY_16),
         (2, 1, "What rises in spring?", SAMPLED_8),
         (0, 2, "What opens at nine?", GREEDY_16)]


def requests() -> list[Instance]:
    made = []
    for doc, (first, count, question, kwargs) in enumerate(ASKED):
        context = "".join(TEXTS[first:first + count]) + "\n\n" + question
        request = Instance("generate_until", {}, (context, dict(kwargs)), doc)
        request.task_name, request.doc_id = "batched" if kwargs is not SAMPLED_8 else "sampled", doc
        made.append(request)
    return made


def harness_lm(folder: Path, batch_size: Any, stats: Path, max_batch_size: int | None = None) -> MaskKVLM:
    """The model as the harness makes it: model args as a string, its own batch size and device beside them."""
    args = f"model={folder},policy=maskkv,budget=8,block_length=8,stats_dir={stats}"
    return MaskKVLM.create_from_arg_string(args, {"batch_size": batch_size, "max_batch_size": max_batch_size,
                                                  "device": "cpu"})


def report_lines(stats: Path) -> list[dict[str, Any]]:
    import json

    (path,) = stats.glob("maskkv_requests_*.jsonl")
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in path.read_text().splitlines()]


@pytest.fixture
def lanes_per_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many sequences each step after the prefill ran."""
    seen: list[int] = []
    shared = driver.step_logits

    def counted(model: Any, lanes: list[Any]) -> Any:
        seen.append(len(lanes))
        return shared(model, lanes)

    monkeypatch.setattr(driver, "step_logits", counted)
    yield seen


def test_batches_give_the_one_at_a_time_answers_and_lines_in_order(tiny_dir: Path, tmp_path: Path,
                                                                     lanes_per_step: list[int]) -> None:
    alone = harness_lm(tiny_dir, 1, tmp_path / "one")
    expected = alone.generate_until(requests())
    assert set(lanes_per_step) == {1}  # batch size 1: the requests one at a time, in order
    assert len(set(expected)) > 2 and all(expected), expected
    assert expected[3] == expected[7].split("m")[0] != expected[7]  # the stop string cut this one
    # (batch size, max_batch_size, the most lanes one forward runs: the five greedy requests at once, else the cap)
    for size, cap, most in ((4, None, 4), ("auto", None, 5), ("auto:2", 2, 2)):
        lanes_per_step.clear()
        stats = tmp_path / f"batched-{size}"
        lm = harness_lm(tiny_dir, size, stats, cap)
        assert lm.generate_until(requests()) == expected, size
        assert max(lanes_per_step) == most, lanes_per_step
        assert report_lines(stats) == report_lines(tmp_path / "one")
        assert set(lm.batch_sizes) == {(16, 0.0), (8, 0.8)}
        assert lm.last_summary.keys() == alone.last_summary.keys() == {"batched", "sampled"}


def test_the_harness_and_model_args_give_the_batch_size(tiny_dir: Path, tmp_path: Path) -> None:
    assert engine_adapter.batch_size_arg(None) is None
    assert engine_adapter.batch_size_arg("auto:4") is None
    assert engine_adapter.batch_size_arg(8) == engine_adapter.batch_size_arg("8") == 8
    for wrong in ("0", "-2", "many"):
        with pytest.raises(UsageError, match="batch_size must be a positive number or auto"):
            engine_adapter.batch_size_arg(wrong)
    lm = MaskKVLM.create_from_arg_string(f"model={tiny_dir},batch_size=3", {"batch_size": None, "device": "cpu"})
    assert lm.batch_size == 3 and lm.max_batch_size is None
    assert MaskKVLM(model=str(tiny_dir), device="cpu").batch_size is None  # auto
    with pytest.raises(UsageError, match="max_batch_size"):
        MaskKVLM(model=str(tiny_dir), device="cpu", max_batch_size=0)


def test_a_block_causal_model_batches_its_requests_too(tiny_tokenizer: Any, tmp_path: Path,
                                                     lanes_per_step: list[int], monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """LLaDA2 takes the batched path like every family: its requests of one answer length and temperature share
    their steps, each with the start it shares with the request before (``document_lens``), and the answers are
    those one at a time gives; LLaDA2's own settings reach its sampler."""
    from maskkv_cli.app.session import Session
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.loading import build_model, save_model

    cfg = named_config("llada2-tiny").with_(vocab_size=len(tiny_tokenizer))
    folder = save_model(build_model(cfg).init_weights(seed=3, std=0.25).eval(), tmp_path / "llada2", tiny_tokenizer)
    document = "".join(TEXTS[:2]) + "\n\n"  # one document, its questions asked one after another
    chosen = []
    for doc, (question, kwargs) in enumerate([("Where?", GREEDY_16), ("When?", GREEDY_16), ("Who?", SAMPLED_8),
                                              ("What opens at nine?", GREEDY_16)]):
        request = Instance("generate_until", {}, (document + question, dict(kwargs)), doc)
        request.task_name, request.doc_id = "shared", doc
        chosen.append(request)
    alone = harness_lm(folder, 1, tmp_path / "one")
    expected = alone.generate_until(chosen)
    assert set(lanes_per_step) == {1}
    lens: list[list[int]] = []
    many = Session.answer_many

    def answer_many(self: Session, prompts: Any, *args: Any, document_lens: Any = None, **kwargs: Any) -> Any:
        lens.append(list(document_lens))
        return many(self, prompts, *args, document_lens=document_lens, **kwargs)

    monkeypatch.setattr(Session, "answer_many", answer_many)
    lanes_per_step.clear()
    lm = harness_lm(folder, 4, tmp_path / "batched")
    assert lm.generate_until(chosen) == expected
    assert max(lanes_per_step) == 3  # the three greedy requests' steps together
    start = len(lm._encode(document))  # about that: the document (and the template's start) is shared
    assert len(lens) == 2 and lens[0][0] == 0 and all(n >= start - 2 for n in lens[0][1:] + lens[1]), lens
    assert report_lines(tmp_path / "batched") == report_lines(tmp_path / "one")
    edited = MaskKVLM.create_from_arg_string(f"model={folder},editing_threshold=0.5,max_post_steps=3,top_k=4",
                                             {"device": "cpu"})
    options = edited.engine.session.llada2
    assert (options.editing_threshold, options.max_post_steps, options.top_k) == (0.5, 3, 4)
    assert edited.settings.block_length is None and edited.settings.editing_threshold == 0.5
    assert request_generation(edited.settings, 64).block_length == 32  # the harness's blocks where none is given


def test_model_args_are_the_shared_run_settings(tiny_dir: Path) -> None:
    lm = MaskKVLM(model=str(tiny_dir), device="cpu", policy="none", budget="8", steps="none", cfg="0.5",
                  remasking="random", seed=3, block_length=16)
    s = lm.settings
    assert (s.policy, s.budget, s.steps, s.cfg_scale, s.remasking, s.seed, s.block_length) == (
        "none", 8, None, 0.5, "random", 3, 16)
    with pytest.raises(UsageError, match="^--alg, --top-p are not options of the llada sampler"):
        MaskKVLM(model=str(tiny_dir), device="cpu", alg="maskgit_plus", top_p="0.9")  # Dream's: refused, not ignored
    for bad, words in (({"budget": "x"}, "budget must be a whole number"), ({"colour": "red"}, "unknown maskkv model"),
                       ({"gen_length": 8}, "set by each request"), ({"budget": 8, "ratio": 0.5}, "not both"),
                       ({"policy": "nope"}, "unknown policy")):
        with pytest.raises(UsageError, match=words):
            MaskKVLM(model=str(tiny_dir), device="cpu", **bad)
