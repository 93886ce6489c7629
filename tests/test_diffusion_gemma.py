"""DiffusionGemma (issue #47, the model part): maskkv's own model and sampler steps against transformers' code.

The reference is transformers' ``DiffusionGemmaForBlockDiffusion`` on a tiny random config (two sliding and two
full layers, a window shorter than the prompt, partial RoPE, 4 experts with 2 per token, vocabulary 512). Every
weight is randomised, norm weights, router scales and both sides' layer scalars included (all ones would hide a
norm taken for another), saved with ``save_pretrained`` and loaded with maskkv's loader. fp32 is compared within
1e-4; bf16 against transformers' own bf16 (bounds measured, see ``test_bf16_close_to_transformers``).
``generate`` is compared token for token in its deterministic limit (t_min 0, t_max 1e-6: every draw is the argmax
and every position is accepted, so the output depends only on each canvas's initial random ids); the default
sampler, which is chaotic (spec, "Determinism"), step by step with the reference's inputs fed back."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers.models.diffusion_gemma",
                    reason="the installed transformers has no DiffusionGemma (needs transformers>=5.25)")

from dgemma_folder import randomise as _randomise  # noqa: E402
from transformers import DiffusionGemmaConfig as HFConfig  # noqa: E402
from transformers import DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from maskkv_cli.errors import ModelLoadError  # noqa: E402
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, checkpoint_shapes, parameter_count  # noqa: E402
from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING, from_hf, named_config, to_hf  # noqa: E402
from maskkv_cli.models.loading import load_diffusion_gemma  # noqa: E402
from maskkv_cli.sampling.diffusion_gemma_steps import (  # noqa: E402
    DiffusionGemmaSampling,
    denoising_step,
    entropy_bound_accept,
    finalize_canvas,
    generate_reference,
    random_canvas,
    renoise,
    stable_and_confident,
    temper,
    temperature,
    token_entropy,
)

V, C, W = 512, 8, 8  # vocabulary, canvas, sliding window
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=W,
            layer_types=[SLIDING, FULL, SLIDING, FULL], num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            max_position_embeddings=1024)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16)
FP32 = 1e-4
BF16 = 1e-2  # measured: 0 (bit-identical), see test_bf16_close_to_transformers
# every draw the argmax, every position accepted; 16 steps (no canvas of this model stops early in this limit)
DETERMINISTIC = dict(t_min=0.0, t_max=1e-6, max_denoising_steps=16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers' model in fp32, the folder it saved)."""
    torch.manual_seed(0)
    ref = DiffusionGemmaForBlockDiffusion(HFConfig(text_config=TEXT, vision_config=VISION, canvas_length=C)).eval()
    _randomise(ref, 0)
    folder = tmp_path_factory.mktemp("dgemma") / "tiny"
    ref.save_pretrained(folder)
    return ref, folder


@pytest.fixture(scope="module")
def ref(saved):
    return saved[0]


@pytest.fixture(scope="module")
def ours(saved):
    return load_diffusion_gemma(saved[1], dtype="float32")


def _prompt(batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _ref_encode(ref, ids, cache=None):
    cache = DynamicCache(config=ref.config.get_text_config()) if cache is None else cache
    start = cache.get_seq_length()
    out = ref.model.encoder(input_ids=ids, cache=cache, position_ids=torch.arange(start, start + ids.shape[1])[None])
    return cache, out.last_hidden_state


# ----- config and loading --------------------------------------------------------------------------------------------

def test_config_reads_the_saved_and_the_released_layouts(saved):
    data = json.loads((saved[1] / "config.json").read_text())
    assert "per_layer_config" in data["text_config"] and "final_logit_softcapping" not in data["text_config"]
    cfg = from_hf(data)
    geometry = [(s.kind, s.head_dim, s.n_kv_heads, s.window, s.has_v_proj) for s in cfg.layers]
    assert geometry == [(SLIDING, 16, 2, W, True), (FULL, 32, 1, None, False)] * 2
    assert cfg.rope_full.rope_type == "proportional" and cfg.rope_full.partial_rotary_factor == 0.25
    assert cfg.final_logit_softcapping == 30.0 and cfg.canvas_length == C and cfg.full_layers == (1, 3)
    released = {"model_type": "diffusion_gemma", "canvas_length": C, "eos_token_id": [1, 106, 50],
                "text_config": {k: v for k, v in TEXT.items()}}  # global_head_dim etc., no per_layer_config
    assert from_hf(released).layers == cfg.layers and from_hf(released).eos_token_ids == (1, 106, 50)
    assert from_hf(to_hf(cfg)) == cfg and from_hf(to_hf(from_hf(released))) == from_hf(released)
    hf_text = HFConfig(text_config=to_hf(cfg)["text_config"], vision_config=VISION).text_config  # transformers agrees
    assert [(hf_text.per_layer_config[i].head_dim, hf_text.per_layer_config[i].num_key_value_heads)
            for i in range(4)] == [(16, 2), (32, 1)] * 2
    assert named_config("diffusiongemma-tiny").layers == cfg.layers
    with pytest.raises(ModelLoadError, match="bidirectional"):
        from_hf({**released, "text_config": {**TEXT, "use_bidirectional_attention": "all"}})


def test_26b_parameter_count_equals_transformers():
    cfg = named_config("diffusiongemma-26b-a4b")
    text = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden_size,
                moe_intermediate_size=cfg.moe_hidden_size, num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                num_global_key_value_heads=2, global_head_dim=512, num_experts=128, top_k_experts=8,
                sliding_window=1024)
    with torch.device("meta"):
        hf = DiffusionGemmaForBlockDiffusion(HFConfig(text_config=text, vision_config=VISION))
    hf_text = sum(p.numel() for n, p in hf.named_parameters() if ".vision_tower." not in n and "embed_vision" not in n)
    assert parameter_count(cfg) == hf_text == 25_250_986_752
    assert cfg.full_layers == (5, 11, 17, 23, 29)
    shapes = checkpoint_shapes(cfg)
    assert shapes["model.decoder.layers.5.self_attn.k_proj.weight"] == (2 * 512, 2816)
    assert "model.decoder.layers.5.self_attn.v_proj.weight" not in shapes
    assert shapes["model.decoder.layers.4.experts.gate_up_proj"] == (128, 2 * 704, 2816)


def test_loader_reads_every_text_tensor_and_skips_vision(ref, ours, saved):
    theirs = ref.state_dict()
    for name, t in [*ours.named_parameters(), *ours.named_buffers()]:
        assert torch.equal(t, theirs[DiffusionGemma.checkpoint_key(name)]), name
    layer = ours.layers[2]
    assert not torch.equal(layer.layer_scalar, layer.encoder_layer_scalar)  # both sides read
    from safetensors import safe_open

    with safe_open(str(saved[1] / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.encoder.vision_tower.") for k in keys)
    read = {DiffusionGemma.parameter_name(k) for k in keys} - {None}
    assert read == {DiffusionGemma.parameter_name(k) for k in checkpoint_shapes(ours.config)}


def test_loader_reads_the_encoder_side_and_refuses_a_mismatch(saved, ours, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(saved[1] / "model.safetensors"))
    moved = {}
    for key, t in state.items():  # the text weights under the encoder's names, the embedding as lm_head
        if key == "model.decoder.embed_tokens.weight":
            key = "lm_head.weight"
        elif key.startswith("model.decoder.") and ".self_conditioning." not in key and not key.endswith("scalar"):
            key = "model.encoder.language_model." + key.removeprefix("model.decoder.")
        moved[key] = t
    config = json.loads((saved[1] / "config.json").read_text())
    folder = tmp_path / "encoder-side"
    folder.mkdir()
    save_file(moved, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    other = load_diffusion_gemma(folder)
    for (name, a), (_, b) in zip(ours.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    (folder / "config.json").write_text(json.dumps({**config, "text_config": {**config["text_config"], "head_dim": 8}}))
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.k_norm\.weight is \[16\], expected \[8\]"):
        load_diffusion_gemma(folder)
    del moved["model.encoder.language_model.layers.1.experts.down_proj"]
    save_file(moved, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="missing keys: model.decoder.layers.1.experts.down_proj"):
        load_diffusion_gemma(folder)


# ----- encoder and decoder, fp32 --------------------------------------------------------------------------------------

def test_encoder_keys_values_and_hidden_states(ref, ours):
    ids = _prompt(2, 20, 1)  # longer than the window: sliding layers keep the latest W - 1
    cache, last = _ref_encode(ref, ids)
    layer_outputs = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: layer_outputs.append(out))
             for m in ref.model.encoder.language_model.layers]
    _ref_encode(ref, ids)
    for h in hooks:
        h.remove()
    out = ours.encode(ids, hidden_states=True)
    assert out.cache.length == 20
    for i, (mine, theirs) in enumerate(zip(out.cache, cache.layers, strict=True)):
        assert mine.keys.shape == theirs.keys.shape == ((2, 2, W - 1, 16) if i % 2 == 0 else (2, 1, 20, 32))
        assert (mine.keys - theirs.keys).abs().max() < FP32 and (mine.values - theirs.values).abs().max() < FP32
    assert (out.last_hidden_state - last).abs().max() < FP32
    for mine, theirs in zip(out.hidden_states[1:], layer_outputs, strict=True):
        assert (mine - theirs).abs().max() < FP32 * theirs.abs().max()


def test_encoding_in_chunks_equals_one_pass(ours):
    ids = _prompt(1, 23, 2)
    whole = ours.encode(ids).cache
    part = ours.encode(ids[:, :5]).cache
    part = ours.encode(ids[:, 5:16], part).cache
    part = ours.encode(ids[:, 16:], part).cache
    assert part.length == whole.length
    for a, b in zip(part, whole, strict=True):
        assert (a.keys - b.keys).abs().max() < 1e-5 and (a.values - b.values).abs().max() < 1e-5


def test_decoder_logits(ref, ours):
    """All-noise canvas, then with the first step's tempered logits as self-conditioning (mid-denoising: half the
    canvas its argmax), then a second canvas after the first joined the cache; the cache stays untouched."""
    ids = _prompt(2, 20, 3)
    cache, _ = _ref_encode(ref, ids)
    mine = ours.encode(ids).cache
    before = [kv.keys.clone() for kv in mine]
    pos = torch.arange(20, 20 + C)[None]
    noise = random_canvas(2, C, V, torch.Generator().manual_seed(4))
    theirs = ref(decoder_input_ids=noise, cache=cache, decoder_position_ids=pos).logits
    first = ours.decode(noise, mine)
    assert first.shape == (2, C, V) and (first - theirs).abs().max() < FP32
    signal = temper(theirs, 48, DiffusionGemmaSampling())
    mid = torch.where(torch.arange(C) % 2 == 0, signal.argmax(-1), noise)
    theirs = ref(decoder_input_ids=mid, cache=cache, self_conditioning_logits=signal, decoder_position_ids=pos).logits
    assert (ours.decode(mid, mine, signal) - theirs).abs().max() < FP32
    assert all(torch.equal(kv.keys, k) for kv, k in zip(mine, before, strict=True))  # decode wrote nothing
    assert [lay.keys.shape[2] for lay in cache.layers] == [W - 1, 20, W - 1, 20]  # nor did transformers' decoder
    committed = theirs.argmax(-1)  # the second canvas
    cache, _ = _ref_encode(ref, committed, cache)
    mine = ours.commit(mine, committed)
    assert mine.length == 28
    for a, b in zip(mine, cache.layers, strict=True):
        assert a.keys.shape == b.keys.shape and (a.keys - b.keys).abs().max() < FP32
    pos = torch.arange(28, 28 + C)[None]
    noise = random_canvas(2, C, V, torch.Generator().manual_seed(5))
    theirs = ref(decoder_input_ids=noise, cache=cache, decoder_position_ids=pos).logits
    assert (ours.decode(noise, mine) - theirs).abs().max() < FP32


# ----- bf16 ---------------------------------------------------------------------------------------------------------

def test_bf16_close_to_transformers(ref, saved):
    """Both in bf16 from the same folder. Measured here: bit-identical (maximum difference 0 in every layer's keys
    and values and in the logits, with and without self-conditioning, on 5 prompts); asserted: within BF16.
    Against fp32 no bound is stated: this deliberately sharp random model (attention logits of std 4 to 6 at softmax
    scale 1) amplifies bf16 rounding, and both implementations' bf16 logits lie up to 29 from the fp32 ones."""
    ref16 = DiffusionGemmaForBlockDiffusion.from_pretrained(saved[1], dtype=torch.bfloat16).eval()
    ours16 = load_diffusion_gemma(saved[1], dtype="bfloat16")
    ids = _prompt(2, 20, 6)
    cache, _ = _ref_encode(ref16, ids)
    mine = ours16.encode(ids).cache
    for a, b in zip(mine, cache.layers, strict=True):
        assert a.keys.dtype == torch.bfloat16
        assert (a.keys.float() - b.keys.float()).abs().max() <= BF16
        assert (a.values.float() - b.values.float()).abs().max() <= BF16
    noise = random_canvas(2, C, V, torch.Generator().manual_seed(7))
    pos = torch.arange(20, 20 + C)[None]
    theirs = ref16(decoder_input_ids=noise, cache=cache, decoder_position_ids=pos).logits
    assert (ours16.decode(noise, mine) - theirs).abs().max() <= BF16
    signal = temper(theirs, 48, DiffusionGemmaSampling()).to(torch.bfloat16)
    theirs = ref16(decoder_input_ids=noise, cache=cache, self_conditioning_logits=signal,
                   decoder_position_ids=pos).logits
    assert (ours16.decode(noise, mine, signal) - theirs).abs().max() <= BF16


# ----- the sampler --------------------------------------------------------------------------------------------------

def test_step_functions_by_hand():
    assert float(temperature(48, 48, 0.4, 0.8)) == pytest.approx(0.8)
    assert float(temperature(1, 48, 0.4, 0.8)) == pytest.approx(0.4 + 0.4 / 48)
    g = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    assert torch.equal(random_canvas(2, C, V, g), torch.randint(0, V, (2, C)))  # the canvas transformers draws
    # entropies 0, 0.08, 0.98, 1.10: the bound counts the accepted entropies but the largest, so the third is accepted
    # (0 + 0.08 <= 0.1) and the fourth not (0 + 0.08 + 0.98 > 0.1)
    logits = torch.full((1, 4, 3), -1e4)
    logits[0, 0, 0] = 0.0  # one-hot: entropy 0
    logits[0, 1] = torch.tensor([5.0, 0.0, 0.0])
    logits[0, 2] = torch.tensor([1.0, 0.0, 0.0])
    logits[0, 3] = torch.tensor([0.0, 0.0, 0.0])
    mask = entropy_bound_accept(logits, 0.1)
    assert mask.tolist() == [[True, True, True, False]]
    assert renoise(torch.tensor([[1, 2, 3, 4]]), mask, torch.tensor([[9, 9, 9, 9]])).tolist() == [[1, 2, 3, 9]]
    # EOS: row 0 finishes at its first EOS (5), the rest pad; row 1 had finished before: all pad
    seq = torch.tensor([[7, 7, 8, 5, 8, 5], [7, 7, 8, 8, 8, 8]])
    out, done = finalize_canvas(seq, torch.tensor([False, True]), 4, (5,), 0)
    assert out.tolist() == [[7, 7, 8, 5, 0, 0], [7, 7, 0, 0, 0, 0]] and done.tolist() == [True, True]
    assert finalize_canvas(seq, torch.tensor([False, False]), 4, (5,), None)[0].tolist() == seq.tolist()
    # stopping: the first step never matches the -1 history; the same confident argmax twice stops
    sharp = torch.full((1, 2, 3), -1e4)
    sharp[..., 0] = 0.0
    argmax = sharp.argmax(-1)
    stop, history = stable_and_confident(argmax, sharp, None, 1, 0.005)
    assert not stop.item()
    assert stable_and_confident(argmax, sharp, history, 1, 0.005)[0].item()


def _ref_generate(ref, ids, seed, **kwargs):
    torch.manual_seed(seed)
    return ref.generate(ids, **kwargs).sequences


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_generate_equals_transformers(ref, ours, seed):
    """The deterministic limit, 3 canvases, a batch of 2 with an EOS that one row emits in its first canvas."""
    ids = _prompt(2, 12, 10 + seed)
    plain = _ref_generate(ref, ids, seed, max_new_tokens=3 * C, **DETERMINISTIC)
    eos = int(plain[0, 12 + 3])  # a token row 0 writes in its first canvas
    kwargs = dict(max_new_tokens=3 * C, eos_token_id=eos, pad_token_id=0, **DETERMINISTIC)
    theirs = _ref_generate(ref, ids, seed, **kwargs)
    settings = DiffusionGemmaSampling(max_new_tokens=3 * C, eos_token_ids=(eos,), pad_token_id=0, **DETERMINISTIC)
    mine = generate_reference(ours, ids, settings, seed=seed)
    assert torch.equal(mine.sequences, theirs)
    assert (theirs[0, 12 + C :] == 0).all()  # row 0 finished: later canvases are pad
    plain_mine = generate_reference(ours, ids, DiffusionGemmaSampling(max_new_tokens=3 * C, **DETERMINISTIC), seed=seed)
    assert torch.equal(plain_mine.sequences, plain) and plain.shape == (2, 12 + 3 * C)


def _record(ref, ids, seed, **kwargs):
    """transformers' ``generate`` with every denoising step's inputs, outputs, accepted positions, sampled canvas
    and global generator state recorded: (steps, sequences)."""
    steps, samplers = [], []
    original_step, original_sampler = ref._denoising_step, ref._prepare_sampler

    def record_step(**kw):
        entry = {"canvas": kw["current_canvas"].clone(), "argmax_in": kw["argmax_canvas"].clone(),
                 "signal": kw["self_conditioning_logits"], "cur_step": kw["cur_step"],
                 "finished_in": kw["finished_denoising"].clone(), "rng": torch.get_rng_state()}
        out = original_step(**kw)
        entry.update(next_canvas=out[0], argmax=out[1], logits=out[2], finished=out[3].clone(),
                     accepted=samplers[-1].accepted_token_mask.clone(), sampled=samplers[-1].last_sampled)
        steps.append(entry)
        return out

    def record_sampler(generation_config):
        sampler = original_sampler(generation_config)
        accept_canvas = sampler.accept_canvas

        def accept_and_record(current, denoiser, logits, cur_step):
            sampler.last_sampled = denoiser.clone()
            return accept_canvas(current, denoiser, logits, cur_step)

        sampler.accept_canvas = accept_and_record
        samplers.append(sampler)
        return sampler

    ref._denoising_step, ref._prepare_sampler = record_step, record_sampler
    try:
        torch.manual_seed(seed)
        sequences = ref.generate(ids, **kwargs).sequences
    finally:
        del ref._denoising_step, ref._prepare_sampler
    return steps, sequences


def _replay(ours, ids, steps, sequences, settings) -> list[int]:
    """Each recorded step run through ``denoising_step`` on our model with the reference's canvas, argmax,
    self-conditioning logits, finished rows and generator state (and our own stability history): everything it
    returns must agree. The accepted positions per step are returned."""
    cache = ours.encode(ids).cache
    history, accepted_counts = None, []
    for i, step in enumerate(steps):
        if step["cur_step"] == settings.max_denoising_steps:  # a new canvas
            if i:
                cache = ours.commit(cache, sequences[:, cache.length : cache.length + C])
            history = None
        gen = torch.Generator()
        gen.set_state(step["rng"])
        out = denoising_step(ours, cache, step["canvas"], step["argmax_in"], step["signal"], step["cur_step"],
                             step["finished_in"], history, settings, gen)
        history = out.history
        t = temperature(step["cur_step"], settings.max_denoising_steps, settings.t_min, settings.t_max)
        # before the temperature (after it |logits| reach 75); rows that stopped hold the previous logits exactly
        assert ((out.logits - step["logits"]) * t).abs().max() < FP32, i
        assert torch.equal(out.accepted, step["accepted"]), i
        for name in ("sampled", "argmax", "finished"):
            assert torch.equal(getattr(out, name), step[name]), (i, name)
        assert torch.equal(out.canvas, step["next_canvas"]), i
        accepted_counts.append(int(out.accepted.sum()))
    return accepted_counts


def test_default_sampler_step_by_step(ref, ours):
    """transformers' default sampler over two canvases, step by step (teacher-forced: the chaotic free run is not
    comparable, spec "Determinism"): logits within 1e-4, accepted positions, sampled and renoised canvases, argmax
    and stopping decisions equal. A second run stops rows one at a time (no stability needed, a confidence
    threshold between the rows' entropies), so rows that stopped hold their canvas while the other goes on."""
    ids = _prompt(2, 12, 20)
    settings = DiffusionGemmaSampling(max_new_tokens=2 * C)
    steps, sequences = _record(ref, ids, 3, max_new_tokens=2 * C)
    assert len(steps) == 2 * settings.max_denoising_steps  # no row stops at the default thresholds here
    counts = _replay(ours, ids, steps, sequences, settings)
    assert min(counts) < 2 * C and max(counts) > 2  # the entropy bound really chose
    # the threshold just above the lowest mean entropy of the first canvas: one row stops there, alone
    entropies = sorted(float(e) for step in steps[: settings.max_denoising_steps]
                       for e in token_entropy(step["logits"]).mean(-1))
    threshold = (entropies[0] + entropies[1]) / 2
    early = DiffusionGemmaSampling(max_new_tokens=2 * C, stability_threshold=0, confidence_threshold=threshold)
    steps, sequences = _record(ref, ids, 3, max_new_tokens=2 * C, stability_threshold=0,
                               confidence_threshold=threshold)
    assert any(bool(s["finished_in"].any()) and not bool(s["finished_in"].all()) for s in steps)
    _replay(ours, ids, steps, sequences, early)
