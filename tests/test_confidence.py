"""Answer confidence: the samplers record each token's probability at the step it is committed."""

from __future__ import annotations

import math

import pytest
import torch
from prompts import random_ids

from maskkv_cli.cli.render import confidence_line
from maskkv_cli.engine.step import plain_logits
from maskkv_cli.models.catalog import empty_note
from maskkv_cli.models.config import named_config
from maskkv_cli.models.dream import Dream
from maskkv_cli.policies import get_policy
from maskkv_cli.sampling.confidence import (
    LOW_CONFIDENCE,
    LOW_CONFIDENCE_STATISTIC,
    Confidence,
    answer_confidence,
)
from maskkv_cli.sampling.dream import DreamGenerationConfig, generate_dream
from maskkv_cli.sampling.llada import GenerationConfig, generate


def test_first_commit_records_the_step0_probability(tiny_model):
    """Greedy, low_confidence: the first token committed is the most probable (position, token) pair of step 0,
    and its recorded probability is that softmax value."""
    m, gen_len = 24, 8
    prompt = random_ids(tiny_model, m)
    mask_id = tiny_model.config.mask_token_id
    x = torch.cat([prompt, torch.full((1, gen_len), mask_id)], 1)
    with torch.no_grad():
        logits = plain_logits(tiny_model, x, torch.arange(m, m + gen_len)).to(torch.float64)
    logits[..., mask_id] = float("-inf")
    best_p, best_tok = logits.softmax(-1).max(-1)  # (1, gen_len)
    first = int(best_p[0].argmax())
    gen = GenerationConfig(gen_length=gen_len, steps=gen_len, block_length=gen_len)
    result = generate(tiny_model, prompt, gen, get_policy("none"))
    assert result.token_probs is not None and result.token_probs.shape == (1, gen_len)
    assert int(result.tokens[0, first]) == int(best_tok[0, first])
    assert math.isclose(float(result.token_probs[0, first]), float(best_p[0, first]), rel_tol=1e-9)


@pytest.mark.parametrize("kw", [{}, {"remasking": "random"}, {"temperature": 0.8}, {"threshold": 0.3}])
def test_every_committed_token_has_a_probability(tiny_model, kw):
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8, seed=1, **kw)
    result = generate(tiny_model, random_ids(tiny_model, 20), gen, get_policy("maskkv"), budget=8)
    probs = result.token_probs[0]
    assert not torch.isnan(probs).any()
    assert bool(((probs > 0) & (probs <= 1)).all())


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_dream_records_probabilities(tiny_tokenizer, alg):
    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    model = Dream(cfg).init_weights(seed=2, std=0.2).eval()
    gen = DreamGenerationConfig(gen_length=8, steps=8, alg=alg, seed=0)
    result = generate_dream(model, random_ids(model, 20), gen, get_policy("full"))
    probs = result.token_probs[0]
    assert not torch.isnan(probs).any()
    assert bool(((probs > 0) & (probs <= 1)).all())


def test_answer_confidence_covers_tokens_before_the_first_stop():
    conf = answer_confidence([5, 6, 7, 1, 9], [0.9, 0.5, 0.7, 0.99, 0.01], stops={1}, mask_id=3)
    assert conf == Confidence(mean=(0.9 + 0.5 + 0.7) / 3, min=0.5, tokens=3)
    assert answer_confidence([1, 5], [0.8, 0.9], stops={1}, mask_id=3) is None  # empty answer


def test_low_confidence_is_marked_by_the_chosen_statistic():
    below, above = LOW_CONFIDENCE - 0.01, LOW_CONFIDENCE + 0.01
    on_mean = LOW_CONFIDENCE_STATISTIC == "mean"
    # the other statistic on the far side of the cut: only the chosen one decides
    low = Confidence(below, 0.99, 3) if on_mean else Confidence(0.99, below, 3)
    sure = Confidence(above, 0.01, 3) if on_mean else Confidence(0.99, above, 3)
    assert "LOW CONFIDENCE" in confidence_line(low) and low.as_dict()["low"] is True
    assert confidence_line(sure).startswith("confidence: mean") and sure.as_dict()["low"] is False
    assert low.as_dict()["statistic"] == LOW_CONFIDENCE_STATISTIC in ("mean", "min")
    assert Confidence(0.2, 0.1, 2).as_dict()["low"] is True


def test_a_statistic_under_the_cut_never_reads_as_the_cut():
    """A min of 0.9453 under a cut of 0.95 was shown "min 0.95 ...; a token below 0.95": rounded down now. A line
    with no document to check against gives no advice to check one."""
    from maskkv_cli.reports.answers import confidence_words

    close = LOW_CONFIDENCE - 0.0047
    conf = (Confidence(close, 0.99, 7) if LOW_CONFIDENCE_STATISTIC == "mean" else Confidence(0.99, close, 7)).as_dict()
    line = confidence_words(conf)
    shown = float(line.split(f"{LOW_CONFIDENCE_STATISTIC} ")[1][:4])
    assert shown < LOW_CONFIDENCE and line.endswith("check the answer in the document")
    assert confidence_words(conf, "").endswith("the model is probably guessing")


def test_empty_note_says_what_the_embedded_model_can_do():
    text = empty_note("answer", embedded=True)
    assert "no answer" in text and "maskkv pull GSAI-ML/LLaDA-8B-Instruct" in text and "magic number" in text
    assert "maskkv pull" not in empty_note("summary", embedded=False)
    assert "--length" in empty_note("summary", embedded=False)  # summarize has no --gen-length
    assert "--gen-length" not in empty_note("summary", embedded=False)
