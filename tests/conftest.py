"""Shared fixtures: a tiny random LLaDA with a BPE tokenizer, saved in the real checkpoint format."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prompts import TEXTS

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from maskkv_cli.models.tokenizer_build import build_bpe_tokenizer

    return build_bpe_tokenizer(TEXTS, vocab_size=320)


@pytest.fixture(scope="session")
def tiny_config(tiny_tokenizer):
    from maskkv_cli.models.config import named_config

    return named_config("tiny").with_(vocab_size=len(tiny_tokenizer))


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    from maskkv_cli.models.llada import LLaDA

    return LLaDA(tiny_config).init_weights(seed=1, std=0.2).eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    from maskkv_cli.models.loading import save_model

    return save_model(tiny_model, tmp_path_factory.mktemp("ckpt") / "tiny-llada", tiny_tokenizer)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The test runs once with one torch thread and once with two (the row floor differs between them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def eval_model_args(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The model args ``maskkv eval`` hands the harness, one dict per run (the harness's run replaced)."""
    pytest.importorskip("lm_eval")
    import maskkv_cli.evaluation.runner as eval_runner
    from maskkv_cli.evaluation.runner import EvalRun

    given: list[dict] = []

    def run_eval(tasks: list[str], model_args: dict, **kwargs: object) -> EvalRun:
        given.append(model_args)
        return EvalRun(None, {}, None)

    monkeypatch.setattr(eval_runner, "run_eval", run_eval)
    return given


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    """Every test gets its own MASKKV_HOME and no configured default model."""
    monkeypatch.setenv("MASKKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MASKKV_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("MASKKV_MODEL", raising=False)


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    """Python's cycle collector off during the test: what the test expects freed must be freed by reference counts
    alone (or by the code's own ``gc.collect()``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.fixture(scope="module")
def session():
    """A session on the embedded tiny model, one per test module (the server's tests; a module may define its own)."""
    from maskkv_cli.app.session import Session
    from maskkv_cli.models.catalog import shipped_model

    return Session(str(shipped_model()))


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    """A document store's folder, one per test module."""
    return tmp_path_factory.mktemp("store")
