"""Build a small byte-level BPE tokenizer with LLaDA's special tokens and chat template, offline."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Special tokens in id order 0..5: small ids for tiny models (the real LLaDA ids are far larger).
SPECIAL_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|mdm_mask|>",
)

LLADA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first %}<|startoftext|>{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512):  # -> PreTrainedTokenizerFast
    """Train a byte-level BPE on ``texts``; returns a transformers fast tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are single tokens (as in LLaMA's tokenizer): a number reads the same in any context.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mdm_mask|>",
        additional_special_tokens=["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
        chat_template=LLADA_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
