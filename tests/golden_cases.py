"""Golden outputs: what the tiny models answer today, recorded once and compared by tests/test_golden.py.

The cases pin behaviour across refactors: the response tokens of every family (LLaDA, Dream, LLaDA-MoE on LLaDA's
sampler, LLaDA2's block diffusion) for every policy at two budgets under three decoding rules each, LLaDA2 in bf16
too (none, full and MaskKV), and the JSON of ``ask``, ``summarize``, ``profile`` and
``demo`` plus the predictions of ``bench quality``, with timings, memory readings and temporary paths
removed. Every case names its policy explicitly, so a change of the default policy does not move them
(``demo`` compares the default policy with ``full`` by design, and says so in its JSON).

Record (after a change that is meant to move them): ``python tests/golden/record.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from prompts import TEXTS

GOLDEN_DIR = Path(__file__).parent / "golden"
BUDGETS = (4, 8)
QUESTION = "What is the special magic number for apple?"
# Keys whose values are measurements of this run on this machine (time, memory), not behaviour.
VOLATILE = {"prefill_s", "step_s", "total_s", "setup_s", "median_step_s", "tokens_per_s", "peak_mem_bytes",
            "mem_kind", "seconds", "seconds_per_sample", "memory_note", "device", "warmup_s", "load_s"}


def build_models(folder: Path) -> dict[str, Any]:
    """The test suite's tiny LLaDA (conftest.py), a tiny Dream, LLaDA-MoE and LLaDA2 (and that LLaDA2 in bf16) on
    the same tokenizer; the LLaDA saved."""
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.dream import Dream
    from maskkv_cli.models.families import build_model
    from maskkv_cli.models.llada import LLaDA
    from maskkv_cli.models.loading import save_model
    from maskkv_cli.models.tokenizer_build import build_bpe_tokenizer

    torch.set_num_threads(1)
    tok = build_bpe_tokenizer(TEXTS, vocab_size=320)
    llada = LLaDA(named_config("tiny").with_(vocab_size=len(tok))).init_weights(seed=1, std=0.2).eval()
    dream = Dream(named_config("dream-tiny").with_(vocab_size=len(tok))).init_weights(seed=2, std=0.2).eval()
    moe = build_model(named_config("llada-moe-tiny").with_(vocab_size=len(tok))).init_weights(seed=3, std=0.2).eval()
    llada2 = build_model(named_config("llada2-tiny").with_(vocab_size=len(tok))).init_weights(seed=4, std=0.25).eval()
    llada2_bf16 = build_model(llada2.config).init_weights(seed=4, std=0.25).to(torch.bfloat16).eval()
    llada_dir = save_model(llada, folder / "tiny-llada", tok)
    return {"tokenizer": tok, "llada": llada, "dream": dream, "llada-moe": moe, "llada2": llada2,
            "llada2-bf16": llada2_bf16, "llada_dir": llada_dir}


def prompt_ids(tok: Any) -> torch.Tensor:
    from maskkv_cli.prompting import chat_prompt_ids, document_question

    return torch.tensor([chat_prompt_ids(tok, document_question("".join(TEXTS[:4]), QUESTION))])


def llada_modes() -> dict[str, Any]:
    from maskkv_cli import GenerationConfig

    base = {"gen_length": 16, "steps": 8, "block_length": 8}
    return {"greedy": GenerationConfig(**base), "temperature": GenerationConfig(**base, temperature=0.7, seed=3),
            "threshold": GenerationConfig(**base, threshold=0.05)}


def dream_modes() -> dict[str, Any]:
    from maskkv_cli.sampling.dream import DreamGenerationConfig

    return {"greedy": DreamGenerationConfig(gen_length=8, steps=8, alg="entropy"),
            "temperature": DreamGenerationConfig(gen_length=8, steps=8, alg="maskgit_plus", temperature=0.8,
                                                 top_p=0.9, seed=3),
            "origin": DreamGenerationConfig(gen_length=8, steps=8, alg="origin", temperature=0.5, seed=4)}


def llada2_modes() -> dict[str, Any]:
    """LLaDA2's modes as (settings, LLaDA2 options): LLaDA2.0 at its default threshold, with a temperature, and
    LLaDA2.1's token editing at its release's quality setting."""
    from maskkv_cli import GenerationConfig
    from maskkv_cli.sampling import LLaDA2Options

    base = {"gen_length": 16, "steps": 16, "block_length": 8}
    return {"greedy": (GenerationConfig(**base), LLaDA2Options()),
            "temperature": (GenerationConfig(**base, temperature=0.7, seed=3), LLaDA2Options()),
            "editing": (GenerationConfig(**base, threshold=0.7), LLaDA2Options(editing_threshold=0.5,
                                                                              max_post_steps=4))}


BF16_POLICIES = ("none", "full", "maskkv")  # LLaDA2 in bf16: the no-cache loop, its exact cache, eviction


def token_cases(models: dict[str, Any], policies: Iterable[str]) -> dict[str, list[int]]:
    """``family/policy/budget/mode`` -> response token ids."""
    from maskkv_cli import generate
    from maskkv_cli.policies.base import get_policy
    from maskkv_cli.sampling.dream import generate_dream

    def llada2(model: Any, ids: torch.Tensor, mode: Any, policy: Any, budget: int) -> Any:
        gen, options = mode
        return generate(model, ids, gen, policy, budget, llada2=options)

    ids = prompt_ids(models["tokenizer"])
    out: dict[str, list[int]] = {}
    policies = list(policies)
    runs = (("llada", models["llada"], generate, llada_modes(), policies),
            ("dream", models["dream"], generate_dream, dream_modes(), policies),
            ("llada-moe", models["llada-moe"], generate, llada_modes(), policies),
            ("llada2", models["llada2"], llada2, llada2_modes(), policies),
            ("llada2-bf16", models["llada2-bf16"], llada2, llada2_modes(), [p for p in policies
                                                                            if p in BF16_POLICIES]))
    for family, model, sample, modes, names in runs:
        for policy in names:
            for budget in BUDGETS:
                for mode, gen in modes.items():
                    result = sample(model, ids, gen, get_policy(policy), budget)
                    out[f"{family}/{policy}/{budget}/{mode}"] = result.tokens[0].tolist()
    return out


def normalize(value: Any, replace: dict[str, str]) -> Any:
    """Drop timings and memory readings, name temporary paths by placeholders, round floats to 6 digits."""
    if isinstance(value, dict):
        return {k: normalize(v, replace) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normalize(v, replace) for v in value]
    if isinstance(value, float):
        return value if math.isnan(value) or math.isinf(value) else round(value, 6)
    if isinstance(value, str):
        for old, new in replace.items():
            value = value.replace(old, new)
    return value


def _invoke(args: list[str]) -> str:
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise AssertionError(f"maskkv {' '.join(args)} failed: {result.output}")
    return result.stdout


def cli_cases(llada_dir: Path, work: Path) -> dict[str, Any]:
    """The JSON of ask (a document longer than the window, cut and RoPE-scaled), summarize, profile, demo and the
    predictions of ``bench quality -n 4``."""
    work.mkdir(parents=True, exist_ok=True)
    doc = work / "report.txt"
    paragraphs = [f"Page {i}. " + TEXTS[i % 4] * 4 for i in range(16)]
    doc.write_text("\f".join(paragraphs), encoding="utf-8")
    model = ["--model", str(llada_dir)]
    gen = ["-n", "16", "--steps", "8", "--block-length", "8"]
    out: dict[str, Any] = {}
    out["ask"] = json.loads(_invoke(["ask", str(doc), QUESTION, "-q", "Where does the river run?", *model, *gen,
                                     "--policy", "maskkv", "--budget", "8", "--json"]))
    out["ask_rope"] = json.loads(_invoke(["ask", str(doc), QUESTION, *model, *gen, "--policy", "snapkv",
                                          "--budget", "16", "--long", "rope-scale", "--json"]))
    out["summarize"] = json.loads(_invoke(["summarize", str(doc), "--length", "10", *model, "--policy", "adakv",
                                           "--budget", "8", "--steps", "16", "--json"]))
    out["profile"] = json.loads(_invoke(["profile", str(doc), QUESTION, *model, *gen, "--policies",
                                         "full,maskkv,snapkv", "--budgets", "4,8", "--no-warmup", "--json"]))
    out["demo"] = json.loads(_invoke(["demo", *model, "--budget", "8", "--length", "200", "--json"]))
    runs = work / "quality"
    _invoke(["bench", "quality", "-n", "4", "--lengths", "256", "--policies", "full,maskkv,snapkv,pyramidkv",
             "--budgets", "8,16", *model, "--out", str(runs), "--fresh", "--json"])
    lines = (runs / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    out["bench_quality_predictions"] = [json.loads(line) for line in lines]
    from maskkv_cli.paths import maskkv_home

    return normalize(out, {str(work): "<work>", str(llada_dir): "<model>", str(maskkv_home()): "<home>"})


def record_all(folder: Path) -> dict[str, Any]:
    from maskkv_cli.policies.base import policy_names

    models = build_models(folder)
    return {"tokens": token_cases(models, policy_names()), "cli": cli_cases(models["llada_dir"], folder / "cli")}
