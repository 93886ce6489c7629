"""The fixed-shape step (``engine/step_runner.py``): same logits and tokens as the eager step, setup kept out of
the step figures, clear refusals where a mode cannot run."""

from __future__ import annotations

import pytest
import torch

from maskkv_cli.engine.prefill import prefill
from maskkv_cli.engine.step import response_logits
from maskkv_cli.engine.step_runner import StepOptions, StepRunner
from maskkv_cli.errors import UsageError
from maskkv_cli.models.config import named_config
from maskkv_cli.models.dream import Dream
from maskkv_cli.policies import get_policy
from maskkv_cli.sampling.common import masked_sequence
from maskkv_cli.sampling.dream import DreamGenerationConfig, generate_dream
from maskkv_cli.sampling.llada import GenerationConfig, generate

GEN = GenerationConfig(gen_length=16, steps=16, block_length=8)


def prompt_of(model, n=48, seed=0):
    return torch.randint(6, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _cache(model, policy="maskkv", budget=12, gen_length=16):
    x, m = masked_sequence(model, prompt_of(model), gen_length)
    pol = get_policy(policy)
    layer_budgets = pol.layer_budgets(len(model.blocks), budget, m) if pol.evicts else None
    rows = torch.arange(m, m + gen_length)
    _, cache, _ = prefill(model, x, m, pol, layer_budgets, rows)
    return x, m, cache


@pytest.mark.parametrize("policy", ["full", "maskkv"])
def test_eager_runner_matches_the_sampler_step(tiny_model, policy):
    x, m, cache = _cache(tiny_model, policy)
    x[:, m + 3] = 17  # a committed token: later steps see a changed response
    rows = torch.tensor([0, 5, 9, 15])
    expected = response_logits(tiny_model, cache, x[:, m:], rows)
    runner = StepRunner(tiny_model, cache, x[:, m:], StepOptions())
    got = runner(x[:, m:], rows)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_row_window_runs_the_last_layer_on_one_block(tiny_model):
    x, m, cache = _cache(tiny_model)
    runner = StepRunner(tiny_model, cache, x[:, m:], StepOptions(), row_window=8)
    for rows in (torch.tensor([1, 2, 7]), torch.tensor([9, 12, 15]), torch.tensor([8])):
        expected = response_logits(tiny_model, cache, x[:, m:], rows)
        torch.testing.assert_close(runner(x[:, m:], rows), expected, atol=1e-5, rtol=1e-5)
        start = int(rows[0]) // 8 * 8  # the sampler passes its block start: no read of rows from the device
        torch.testing.assert_close(runner(x[:, m:], rows, start), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="window"):
        runner(x[:, m:], torch.tensor([6, 9]))


def test_compiled_generation_gives_the_eager_tokens(tiny_model):
    ids = prompt_of(tiny_model)
    eager = generate(tiny_model, ids, GEN, get_policy("maskkv"), 12)
    compiled = generate(tiny_model, ids, GEN, get_policy("maskkv"), 12, step_options=StepOptions(compile=True))
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.step_mode == "compile" and eager.stats.step_mode == "eager"
    assert compiled.stats.setup_s > 0 and eager.stats.setup_s == 0
    # the one-time compilation is reported apart, not inside the prefill or the end-to-end time
    assert compiled.stats.total_s >= compiled.stats.prefill_s + sum(compiled.stats.step_s) * 0.99
    assert compiled.stats.prefill_s < compiled.stats.setup_s + eager.stats.prefill_s * 10
    # a second generation of the same shapes (the benchmark's timed run after its warm-up) reuses the code
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    again = generate(tiny_model, ids, GEN, get_policy("maskkv"), 12, step_options=StepOptions(compile=True))
    assert torch.equal(again.tokens, eager.tokens)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_compiled_step_of_two_rows_compiles_once(tiny_model, monkeypatch):
    """A generation of two rows (a batch of prompts, or guidance) steps on ``x[:, split:]``, a strided view: every
    call runs on the setup's buffer, so the step compiles in the setup only, never again inside a timed step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import maskkv_cli.sampling.forward as forward

    after_setup: list[int] = []

    class Counted(StepRunner):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            after_setup.append(counters["stats"]["unique_graphs"])

    monkeypatch.setattr(forward, "StepRunner", Counted)
    torch._dynamo.reset()
    ids = torch.cat([prompt_of(tiny_model, 44, 1), prompt_of(tiny_model, 44, 2)])
    eager = generate(tiny_model, ids, GEN, get_policy("maskkv"), 12)
    compiled = generate(tiny_model, ids, GEN, get_policy("maskkv"), 12, step_options=StepOptions(compile=True))
    assert len(after_setup) == 1 and after_setup[0] > 0
    assert counters["stats"]["unique_graphs"] == after_setup[0]  # nothing compiled in the 15 later steps
    assert torch.equal(compiled.tokens, eager.tokens)


def test_compiled_dream_generation_gives_the_eager_tokens(tiny_tokenizer):
    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    dream = Dream(cfg).init_weights(seed=2, std=0.2).eval()
    gen = DreamGenerationConfig(gen_length=8, steps=8, alg="maskgit_plus")
    ids = prompt_of(dream, 40)
    eager = generate_dream(dream, ids, gen, get_policy("maskkv"), 10)
    compiled = generate_dream(dream, ids, gen, get_policy("maskkv"), 10, step_options=StepOptions(compile=True))
    assert torch.equal(compiled.tokens, eager.tokens)


def test_policy_none_ignores_step_options(tiny_model):
    ids = prompt_of(tiny_model, 24)
    out = generate(tiny_model, ids, GEN, get_policy("none"), step_options=StepOptions(compile=True))
    assert out.stats.setup_s == 0  # no cache, no fixed-shape step to build


def test_cuda_graph_needs_cuda(tiny_model):
    x, m, cache = _cache(tiny_model)
    with pytest.raises(UsageError, match="^the cuda-graph step mode needs a CUDA device, the model is on cpu$"):
        StepRunner(tiny_model, cache, x[:, m:], StepOptions(cuda_graph=True))  # (no command has a --cuda-graph)


def test_cuda_graph_refuses_a_mixture_of_experts_model():
    """Its routing counts each expert's rows on the host, which a CUDA graph cannot capture: refused in one line."""
    from maskkv_cli.models.families import build_model

    moe = build_model(named_config("llada-moe-tiny")).init_weights(seed=1, std=0.2).eval()
    x, m, cache = _cache(moe)
    with pytest.raises(UsageError, match="^the cuda-graph step mode cannot capture a mixture-of-experts model"):
        StepRunner(moe, cache, x[:, m:], StepOptions(cuda_graph=True))


def test_step_options_labels():
    assert StepOptions().label == "eager" and StepOptions().eager
    assert StepOptions(compile=True, cuda_graph=True).label == "compile+cuda-graph"
