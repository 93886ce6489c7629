"""``--batch-size auto`` runs prompts together only where a batch shares enough of their work
(``engine/batch_work.py``): long prompts with short answers run one at a time, and the line says why."""

from __future__ import annotations

import pytest

from maskkv_cli.app.pipeline import batch_size_for, prompt_lengths
from maskkv_cli.engine.batch_work import MIN_SHARED, batch_work
from maskkv_cli.engine.plan import CacheConfig
from maskkv_cli.engine.prefill import join_rows
from maskkv_cli.sampling import GenerationConfig

GEN = GenerationConfig(gen_length=8, steps=8, block_length=8)  # the embedded model's defaults


def test_rows_of_long_and_short_prompts() -> None:
    # 8 steps of 8 rows after a prefill of 1,500 rows that runs alone: 64 of 1,564 rows shared
    work = batch_work([1500, 1500], steps=8, step_rows=8, cached=True, join_rows=512)
    assert (work.rows, work.shared_rows, work.unjoined) == (2 * 1564, 2 * 64, 2)
    assert work.share == pytest.approx(64 / 1564) and not work.pays
    short = batch_work([70, 90], steps=8, step_rows=8, cached=True, join_rows=512)
    assert short.share == 1.0 and short.pays and short.unjoined == 0
    # more steps over the same long prompt: 40% shared, measured no faster in a batch (docs/scale.md)
    many_steps = batch_work([1500], steps=32, step_rows=32, cached=True, join_rows=512)
    assert many_steps.share == pytest.approx(1024 / 2524) and not many_steps.pays
    # a long answer over it: its steps are nearly all of the work
    assert batch_work([1500], steps=256, step_rows=256, cached=True, join_rows=512).pays
    # no cache: every step runs the whole prompt again, alone as its prefill does
    uncached = batch_work([1500], steps=8, step_rows=8, cached=False, join_rows=512)
    assert uncached.share == 0.0 and "every step runs the prompt again" in uncached.reason()
    assert batch_work([100], steps=8, step_rows=8, cached=False, join_rows=512).share == 1.0
    assert batch_work([], steps=8, step_rows=8, cached=True, join_rows=512).pays
    assert 0 < MIN_SHARED < 1


def test_auto_runs_long_prompts_with_short_answers_one_at_a_time(session) -> None:
    long_text = " ".join(f"Clause {i} says the licensee keeps the notice." for i in range(400))
    items = [(long_text, f"What does clause {i} say?") for i in range(6)]
    lengths = [n for c, q in items for n, _ in prompt_lengths(session, c, q, GEN.gen_length, "truncate")]
    assert min(lengths) > join_rows(session.model)
    size, line = batch_size_for(session, items, GEN, CacheConfig("maskkv", 64), "truncate", None)
    assert size == 1
    assert line is not None and "batch size auto: 1" in line and "run alone" in line and "would fit" in line
    # asked for, a batch size is kept whatever the work
    assert batch_size_for(session, items, GEN, CacheConfig("maskkv", 64), "truncate", 8) == (8, None)


def test_auto_batches_short_prompts_and_long_answers(session) -> None:
    short = [("The key is 4417.", f"What is the key? ({i})") for i in range(6)]
    size, line = batch_size_for(session, short, GEN, CacheConfig("maskkv", 64), "truncate", None)
    assert size == 6 and line is not None and "all 6 prompts at once" in line
    long_text = " ".join(f"Clause {i} says the licensee keeps the notice." for i in range(400))
    long_answers = GenerationConfig(gen_length=256, steps=256, block_length=32)
    items = [(long_text, f"Summarise clause {i}.") for i in range(6)]
    size, _ = batch_size_for(session, items, long_answers, CacheConfig("maskkv", 64), "truncate", None)
    assert size == 6


def test_prompt_lengths_count_every_part(session) -> None:
    text = " ".join(f"Clause {i} says the licensee keeps the notice." for i in range(2000))
    question = "What does clause 7 say?"
    parts = prompt_lengths(session, text, question, GEN.gen_length, "parts")
    one = prompt_lengths(session, text, question, GEN.gen_length, "truncate")
    assert len(parts) > 1 and len(one) == 1
    assert max(n for n, _ in parts) <= session.window and one[0][0] <= session.window
    assert all(doc < n for n, doc in parts + one)


def test_a_stored_document_prefix_is_not_counted_as_prefill_work(tmp_path, tiny_tokenizer) -> None:
    """On a block-causal model the document's whole blocks are computed once for every question about it
    (``Session.prefix_rows``): many short questions about one long document still batch; without a cache they do
    not."""
    from maskkv_cli.app.session import Session
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.loading import build_model, save_model

    # a window wider than the rows joined, so that the document's prompt alone would be too long to join
    cfg = named_config("llada2-tiny").with_(vocab_size=len(tiny_tokenizer), max_sequence_length=2048)
    folder = save_model(build_model(cfg).init_weights(seed=3, std=0.25).eval(), tmp_path / "llada2", tiny_tokenizer)
    session = Session(str(folder))
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
    long_text = " ".join(f"Clause {i} says the licensee keeps the notice." for i in range(400))
    items = [(long_text, f"What does clause {i} say?") for i in range(4)]
    (n, doc), = prompt_lengths(session, *items[0], gen.gen_length, "truncate")
    assert n > join_rows(session.model) and session.prefix_rows(doc, n, gen, CacheConfig("maskkv", 64)) >= doc - 8
    size, _ = batch_size_for(session, items, gen, CacheConfig("maskkv", 64), "truncate", None)
    assert size == 4
    assert session.prefix_rows(doc, n, gen, CacheConfig("none")) == 0
    assert batch_size_for(session, items, gen, CacheConfig("none"), "truncate", None)[0] == 1


def test_a_worker_whose_driver_is_gone_ends_quietly(monkeypatch) -> None:
    """The driver killed (kill -9) while a worker answers: sending its row raised BrokenPipeError and each worker
    printed a traceback; it ends quietly now, as when the pipe's other end is closed (EOFError)."""
    import maskkv_cli.batch.local as local

    class Stub:
        def __init__(self, spec, name) -> None:
            pass

        def run(self, message, text):
            return {"answer": "4821"}

    class GoneDriver:
        def __init__(self) -> None:
            self.sent = 0

        def send(self, item) -> None:
            self.sent += 1
            if item[0] == "done":
                raise BrokenPipeError(32, "Broken pipe")

        def recv(self):
            return ({"id": "j1"}, "text")

    monkeypatch.setattr(local, "Worker", Stub)
    conn = GoneDriver()
    local._process_main(None, "0", conn)  # type: ignore[arg-type]
    assert conn.sent == 2  # "ready", then the row the driver never got
