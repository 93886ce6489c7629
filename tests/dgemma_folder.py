"""A tiny DiffusionGemma checkpoint folder as transformers writes it, for the tests and ``scripts/make_guide.py``.

``transformers``' own ``DiffusionGemmaForBlockDiffusion`` (two sliding and two full layers, window 8, canvas 8, 4
experts of which 2 per token, 4096 positions, its vision tower included) with every text weight random, saved by
``save_pretrained``; a small byte-level BPE tokenizer trained on the tests' texts whose first ids are Gemma's
(``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<|turn>`` 3, ``<turn|>`` 4) and no chat template; a
``generation_config.json`` as transformers writes it (16 denoising steps, the released schedule and stopping rule,
EOS ids 1 and 4, pad 0)."""

from __future__ import annotations

from pathlib import Path

import torch
from prompts import TEXTS

CANVAS, WINDOW, STEPS, EOS = 8, 8, 16, [1, 4]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]  # ids 0 .. 4, as Gemma's first ones


def tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(TEXTS), trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   additional_special_tokens=SPECIALS[3:], clean_up_tokenization_spaces=False)


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every text weight random (norm weights and scales in [0.5, 1.5), matrices ~ 1/sqrt(fan in), a larger
    embedding), both sides' layer scalars included."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(1.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def generation_config(folder: Path, eos: list[int]) -> None:
    """``generation_config.json`` with these EOS ids, as transformers writes it."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    DiffusionGemmaGenerationConfig(max_denoising_steps=STEPS, sampler_config=EntropyBoundSamplerConfig(0.1),
                                   t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005,
                                   eos_token_id=eos, pad_token_id=0).save_pretrained(folder)


def build_folder(out: Path) -> Path:
    """The folder (see the module doc) at ``out``."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    tok = tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2, num_experts=4,
                top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=4096)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    randomise(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    generation_config(out, EOS)
    return out
