from __future__ import annotations

import json

import pytest
import torch
from prompts import EVICTING, random_ids

from maskkv_cli.models.config import named_config
from maskkv_cli.models.dream import Dream
from maskkv_cli.models.families import parameter_shapes
from maskkv_cli.models.loading import load_model, save_model
from maskkv_cli.policies import PolicyOptions, get_policy
from maskkv_cli.sampling.dream import DreamGenerationConfig, generate_dream

GEN = DreamGenerationConfig(gen_length=8, steps=8, alg="maskgit_plus")


@pytest.fixture(scope="module")
def dream(tiny_tokenizer):
    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    return Dream(cfg).init_weights(seed=2, std=0.2).eval()


def test_dream_7b_shapes_and_parameter_count():
    shapes = parameter_shapes(named_config("dream-7b"))
    h, kv, inter, vocab, n = 3584, 512, 18944, 152064, 28
    assert shapes["model.embed_tokens.weight"] == (vocab, h) and shapes["lm_head.weight"] == (vocab, h)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv, h)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (kv,)
    assert shapes["model.layers.27.mlp.down_proj.weight"] == (h, inter)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    per_layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * inter + 2 * h
    expected = 2 * vocab * h + n * per_layer + h
    total = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"dream-7b parameters: {total:,}")
    assert total == expected == 7_615_616_512


def test_tiny_dream_round_trip_in_upstream_layout(tmp_path, dream, tiny_tokenizer):
    folder = save_model(dream, tmp_path / "dream", tiny_tokenizer)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "Dream" and cfg["num_key_value_heads"] == 2
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.gate_proj.weight" in keys and "model.layers.0.self_attn.q_proj.bias" in keys
    loaded = load_model(folder)
    assert isinstance(loaded, Dream)
    ids = random_ids(dream, 12)
    assert torch.equal(loaded(ids), dream(ids))


def test_logits_are_shifted(dream):
    ids = random_ids(dream, 10)
    x = dream.embed(ids)
    rope = dream.rope(torch.arange(10))
    for block in dream.blocks:
        x = block(x, rope)
    unshifted = dream.head(x)
    shifted = dream(ids)
    assert torch.equal(shifted[:, 1:], unshifted[:, :-1])
    assert torch.equal(shifted[:, 0], unshifted[:, 0])
    assert not torch.allclose(shifted[:, 1:], unshifted[:, 1:])


def copy_model(tiny_tokenizer) -> Dream:
    """Blocks do nothing (zero weights), the head reads the embedding back: hidden i predicts token i."""
    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    model = Dream(cfg).init_weights(seed=3, std=1.0).eval()
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.zero_()
        model.lm_head.weight.copy_(model.model["embed_tokens"].weight)
    return model


@pytest.mark.parametrize("policy", ["none", "full", "maskkv"])
def test_shift_decides_the_answer(tiny_tokenizer, policy):
    """Shifted, the first response position reads the last prompt token's hidden state and copies that token.
    Unshifted, it would read its own mask embedding and predict something else."""
    model = copy_model(tiny_tokenizer)
    ids = random_ids(model, 20, seed=4)
    out = generate_dream(model, ids, DreamGenerationConfig(gen_length=6, steps=6, alg="maskgit_plus"),
                         get_policy(policy), 8)
    last = int(ids[0, -1])
    assert int(out.tokens[0, 0]) == last
    seq = torch.cat([ids, torch.full((1, 6), model.config.mask_token_id)], 1)
    hidden = model.embed(seq)  # the blocks are identities here
    unshifted = model.head(hidden[:, 20])
    unshifted[..., model.config.mask_token_id] = float("-inf")
    assert int(unshifted.argmax(-1)) != last


@pytest.mark.parametrize("policy", EVICTING)
def test_dream_budget_at_least_prompt_reproduces_full(dream, policy):
    ids = random_ids(dream)
    full = generate_dream(dream, ids, GEN, get_policy("full")).tokens
    for budget in (39, 100):  # the cached segment is the prompt minus its last token
        assert torch.equal(generate_dream(dream, ids, GEN, get_policy(policy), budget).tokens, full)


@pytest.mark.parametrize("policy", EVICTING)
def test_dream_kept_counts_per_kv_head(dream, policy):
    budget = 6
    out = generate_dream(dream, random_ids(dream), GEN, get_policy(policy, PolicyOptions(window=4)), budget)
    cfg = dream.config
    assert out.layer_budgets is not None and sum(out.layer_budgets) == cfg.n_layers * budget
    for rec in out.records:
        heads = rec.head_budgets[0]
        assert heads.shape == (cfg.n_kv_heads,)
        assert int(heads.sum()) == cfg.n_kv_heads * rec.layer_budget


def test_dream_residual_entries_per_kv_head(dream):
    budget = 6
    ids = random_ids(dream, 80)
    on = get_policy("maskkv-residual", PolicyOptions(residual_spread=0.01))  # random weights: force residual entries
    out = generate_dream(dream, ids, GEN, on, budget)
    cfg = dream.config
    used = 0
    for rec in out.records:
        assert rec.residual is not None and rec.residual.shape == (1, cfg.n_kv_heads)
        res = rec.residual[0].to(torch.int64)
        assert int((rec.head_budgets[0] + res).sum()) == cfg.n_kv_heads * rec.layer_budget  # no extra entries
        used += int(res.sum())
    assert used > 0 and out.stats.kv_entries == cfg.n_layers * cfg.n_kv_heads * budget
    full = generate_dream(dream, ids, GEN, get_policy("full")).tokens
    assert torch.equal(generate_dream(dream, ids, GEN, on, 100).tokens, full)


def test_cache_bytes_scale_with_kv_heads(dream):
    out = generate_dream(dream, random_ids(dream, 64), GEN, get_policy("full"))
    cfg = dream.config
    per_entry = 2 * cfg.head_dim * 4  # k and v, fp32
    assert out.stats.kv_bytes == cfg.n_layers * cfg.n_kv_heads * 63 * per_entry
    assert out.stats.kv_bytes == out.stats.kv_full_bytes


def test_dream_algorithms_run(dream):
    for alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
        out = generate_dream(dream, random_ids(dream), DreamGenerationConfig(gen_length=8, steps=4, alg=alg,
                                                                         temperature=0.5, top_p=0.9, top_k=20),
                             get_policy("maskkv"), 8)
        assert not bool((out.tokens == dream.config.mask_token_id).any())


def test_cli_picks_the_family_from_config(tmp_path, dream, tiny_tokenizer):
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    folder = save_model(dream, tmp_path / "dream", tiny_tokenizer)
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the mill. " * 30)
    result = CliRunner().invoke(app, ["ask", str(doc), "Where?", "--model", str(folder), "-n", "8", "--steps", "4",
                                      "--budget", "8", "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)["answers"][0]
    assert answer["stats"]["kv_bytes"] < answer["stats"]["kv_full_bytes"] and answer["stats"]["steps_run"] <= 4
    # a folder without a chat template (the test tokenizer brings LLaDA's) gets Dream's own format, Qwen2's ChatML
    from maskkv_cli.app.session import Session

    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    session = Session(folder)
    prompt = session.tokenizer.decode(session.prompt_ids("Where?"))
    assert prompt.replace(" ", "").startswith("<|im_start|>system") and "<|start_header_id|>" not in prompt


def test_profile_shows_kv_heads_for_gqa(tmp_path, dream, tiny_tokenizer):
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    folder = save_model(dream, tmp_path / "dream", tiny_tokenizer)
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the mill. " * 30)
    args = ["profile", str(doc), "Where?", "--model", str(folder), "-n", "8", "--steps", "4", "--budgets", "8"]
    result = CliRunner().invoke(app, args + ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["heads"] == "KV heads"
    assert len(data["runs"][0]["head_budgets"][0]) == dream.config.n_kv_heads
    text = CliRunner().invoke(app, args)
    assert "layers x KV heads" in text.output and "GQA model" in text.output


def test_cli_dream_sampler_options(tmp_path, dream, tiny_tokenizer):
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    folder = save_model(dream, tmp_path / "dream", tiny_tokenizer)
    base = ["generate", "hello there", "--model", str(folder), "-n", "8", "--steps", "4", "--json"]
    for extra in (["--alg", "origin"], ["--alg", "topk_margin", "--temperature", "0.7", "--top-p", "0.9",
                                          "--top-k", "20"]):
        result = CliRunner().invoke(app, base + extra)
        assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, base + ["--alg", "nope"])
    assert bad.exit_code == 2 and "--alg must be one of" in bad.stderr
    for extra, flag in ((["--cfg", "1"], "--cfg"), (["--remasking", "random"], "--remasking"),
                        (["--block-length", "4"], "--block-length"), (["--threshold", "0.5"], "--threshold")):
        refused = CliRunner().invoke(app, base + extra)  # LLaDA's options: Dream's loop has no use for them
        assert refused.exit_code == 2 and refused.stderr == f"error: {flag} is not an option of the dream sampler " \
            "(docs/models.md has what it takes)\n", refused.output
    quality = CliRunner().invoke(app, ["bench", "quality", "--model", str(folder), "--block-length", "8",
                                       "--samples", "1", "--out", str(tmp_path / "q")])
    assert quality.exit_code == 2 and quality.stderr.startswith("error: --block-length is not an option of the dream")


def _with_upstream_twin(dtype: torch.dtype) -> tuple[Dream, torch.nn.Module]:
    """A tiny Dream and a ``transformers`` Qwen2 with the same weights (Dream's upstream architecture), both in
    ``dtype``. Only the parameters are cast: the rotary ``inv_freq`` buffer stays fp32, as upstream loads it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = named_config("dream-tiny").with_(vocab_size=300)
    ours = Dream(cfg).init_weights(seed=2, std=0.2).eval()
    hf = Qwen2Config(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.mlp_hidden_size,
                     vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                     max_position_embeddings=cfg.max_sequence_length, tie_word_embeddings=False, hidden_act="silu")
    hf._attn_implementation = "sdpa"
    theirs = Qwen2ForCausalLM(hf).eval()
    theirs.load_state_dict({Dream.checkpoint_key(k): v for k, v in ours.state_dict().items()}, strict=True)
    for p in theirs.parameters():
        p.data = p.data.to(dtype)
    return ours.to(dtype), theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dream_logits_match_a_bidirectional_transformers_qwen2(dtype):
    """Upstream Dream is Qwen2 without the causal mask, its logits shifted by one; in half precision it casts the
    fp32 cos/sin to the activation dtype before rotating, and so must we for the logits to match."""
    ours, theirs = _with_upstream_twin(dtype)
    t = 200
    ids = torch.randint(0, 300, (1, t), generator=torch.Generator().manual_seed(0))
    everything = torch.ones(1, 1, t, t, dtype=torch.bool)  # a full 4D mask: no causal masking
    with torch.no_grad():
        got = ours(ids)[:, 1:]
        want = theirs(input_ids=ids, attention_mask={"full_attention": everything}).logits[:, :-1]
        causal = theirs(input_ids=ids, attention_mask={"full_attention": everything.tril()}).logits[:, :-1]
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)
    assert not torch.allclose(got.float(), causal.float(), atol=0.1)  # the mask really is bidirectional


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "entropy"])
def test_dream_one_row_equals_each_row_of_two_copies(dream, alg):
    """Dream's loop of one row skips the still-masked bookkeeping a batch of rows needs; a prompt of two identical
    rows runs the general path, and each of its rows must commit what the one row commits."""
    gen = DreamGenerationConfig(gen_length=8, steps=4, alg=alg, temperature=0.0 if alg != "origin" else 0.5)
    prompt = random_ids(dream)
    one = generate_dream(dream, prompt, gen, get_policy("maskkv"), 8)
    two = generate_dream(dream, prompt.expand(2, -1).clone(), gen, get_policy("maskkv"), 8)
    if alg == "origin":  # its random draws cover every row: the two rows draw other numbers than the one row
        assert not bool((two.tokens == dream.config.mask_token_id).any())
        return
    assert torch.equal(two.tokens, one.tokens.expand(2, -1))
    assert torch.equal(two.token_probs, one.token_probs.expand(2, -1))


def test_any_step_count_fits_dreams_one_block(tmp_path, dream, tiny_tokenizer):
    """Dream's response is one block, yet the default blocks of 32 made every command refuse a --steps that is no
    multiple of the length / 32 (`-n 64 --steps 5`: "must be a multiple of the number of blocks 2"), with no
    --block-length to get round it (Dream refuses it). generate, ask, summarize and batch take it now."""
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    folder = save_model(dream, tmp_path / "dream", tiny_tokenizer)
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the mill. " * 30)
    (tmp_path / "qs.txt").write_text("Where?\n")
    runs = [["generate", "hello", "-n", "64", "--steps", "5"],
            ["ask", str(doc), "Where?", "-n", "64", "--steps", "5", "--budget", "8"],
            ["summarize", str(doc), "--length", "20", "--steps", "5"],
            ["batch", "--docs", str(doc), "--questions", str(tmp_path / "qs.txt"), "-n", "64", "--steps", "5",
             "--out", str(tmp_path / "out")]]
    for args in runs:
        result = CliRunner().invoke(app, [*args, "--model", str(folder), "--json"])
        assert result.exit_code == 0, (args[0], result.output)
        assert "multiple of the number of blocks" not in result.output
    steps = json.loads(CliRunner().invoke(app, ["generate", "hello", "-n", "64", "--steps", "5", "--model",
                                                str(folder), "--json"]).stdout)["stats"]["steps_run"]
    assert steps <= 5
