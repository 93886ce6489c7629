"""Tokenizer loading, the chat template, and decoding of generated ids."""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import Any, Protocol

from maskkv_cli.errors import ModelLoadError
from maskkv_cli.paths import VOCABULARY_FILES, resolve_model_path

# What the embedded model answers when the asked fact is not in the document (it is trained to, as SQuAD 2.0's
# unanswerable questions teach); other code compares answers with it, so it is written in one place only.
NO_ANSWER = "not in the document"


class StopTokens(Protocol):
    """The end-of-text ids of a model's config (``models.config.ModelConfig`` has them): prompting reads only these,
    so it needs no model code."""

    @property
    def eos_token_id(self) -> int: ...

    @property
    def eot_token_id(self) -> int | None: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``AutoTokenizer`` from a local model folder (or a locally cached HF id); never downloads."""
    return tokenizer_from_folder(resolve_model_path(path))


def tokenizer_from_folder(folder: Path) -> Any:
    """``load_tokenizer`` of a folder already resolved (a session's ``ModelFolder.path``)."""
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in VOCABULARY_FILES):  # (the rule ``maskkv models`` lists them by)
        raise ModelLoadError(f"model folder {folder} has no tokenizer vocabulary ({', '.join(VOCABULARY_FILES)})")
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # silence "model of type llada" notes: the class comes from tokenizer files
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types here, some over several lines
        said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        vocabulary = "" if any((folder / f).is_file() for f in VOCABULARY_FILES) else (
            f" (the folder has none of {', '.join(VOCABULARY_FILES)}: copy the checkpoint's tokenizer.json into it)")
        raise ModelLoadError(f"cannot load the tokenizer from {folder}: {said}{vocabulary}") from None
    finally:
        hf_logging.set_verbosity(level)


def llada_template(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """LLaDA's chat template, used when the tokenizer carries none."""
    parts = ["<|startoftext|>"]
    for msg in messages:
        parts.append(f"<|start_header_id|>{msg['role']}<|end_header_id|>\n\n{msg['content'].strip()}<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


# The Ling chat format of LLaDA2.x and LLaDA-MoE (their released tokenizers carry it as ``chat_template``): a
# system turn that turns thinking off unless the messages bring one, then HUMAN / ASSISTANT turns.
LING_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}<role>SYSTEM</role>detailed thinking off<|role_end|>{%- endif -%}"
    "{%- for m in messages -%}<role>{{ {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT'}[m['role']] }}"
    "</role>{{ m['content'] }}<|role_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<role>ASSISTANT</role>{%- endif -%}"
)
# Gemma 4's turn format (DiffusionGemma's text stack): ``<|turn>ROLE\n...<turn|>\n`` per message, the assistant
# as ``model``, and ``<|turn>model\n`` to answer; the bos token first. A released checkpoint brings its own
# template (``chat_template.jinja``), which wins; this one is for folders without it.
GEMMA_TEMPLATE = (
    "{%- if bos_token -%}{{ bos_token }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + (m['content'] | trim) + "
    "'<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)
# Qwen2's ChatML (Dream's text stack, a Qwen2.5 model): ``<|im_start|>ROLE\n...<|im_end|>\n`` per message, a default
# system turn where the messages bring none, and ``<|im_start|>assistant\n`` to answer. A released Dream checkpoint
# brings its own template, which wins; this one is for folders without it.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CHAT_FORMATS = ("llada", "ling", "gemma", "chatml")
TEMPLATES = {"ling": LING_TEMPLATE, "gemma": GEMMA_TEMPLATE, "chatml": CHATML_TEMPLATE}


def use_chat_format(tokenizer: Any, chat_format: str) -> Any:
    """Give a tokenizer without a chat template its model family's format (``llada`` needs none: it is
    ``llada_template``, the fallback of ``chat_prompt_ids``); a tokenizer with a template keeps its own."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {chat_format!r}")
    if chat_format in TEMPLATES and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = TEMPLATES[chat_format]
    return tokenizer


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)`` as a list.

    A Hugging Face fast tokenizer's ``encode`` computes each token's character offsets and converts the backend's
    encoding, which nothing here reads. ``tokenizers``' own ``encode_batch_fast`` leaves the offsets out and gives the
    same ids (the same normaliser, pre-tokenizer and model run): 75 against 120 us for a prompt of 80 tokens on the
    embedded tokenizer. It is called directly where it would see what ``encode`` sets up first: no truncation or
    padding set on the backend, and the tokenizer's own ``split_special_tokens`` already set on it. Any other
    tokenizer is asked through ``encode``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (hasattr(backend, "encode_batch_fast") and backend.truncation is None and backend.padding is None
            and getattr(backend, "encode_special_tokens", False) == bool(getattr(tokenizer, "split_special_tokens",
                                                                                  False))):
        return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_ids(tokenizer: Any, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn in the chat template plus the assistant header."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = llada_template(messages)
    return text_ids(tokenizer, text)


def stop_ids(tokenizer: Any, cfg: StopTokens) -> set[int]:
    """The ids that end an answer: the config's EOS, EOT and further stop ids, and the tokenizer's ``<|eot_id|>``
    and EOS."""
    ids = {cfg.eos_token_id, *cfg.stop_token_ids}
    if cfg.eot_token_id is not None:
        ids.add(cfg.eot_token_id)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>") if hasattr(tokenizer, "convert_tokens_to_ids") else None
    if isinstance(eot, int) and eot >= 0 and eot != getattr(tokenizer, "unk_token_id", None):
        ids.add(eot)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def decode_answer(tokenizer: Any, ids: list[int], stops: set[int], mask_id: int) -> str:
    """Text of the response up to its first EOS/EOT (the padding the Instruct model emits)."""
    out: list[int] = []
    for t in ids:
        if t in stops:
            break
        if t != mask_id:
            out.append(t)
    text = tokenizer.decode(out, skip_special_tokens=True)
    # Control characters (e.g. ESC from a random model's byte tokens) must never reach a terminal.
    return "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc").strip()


def document_question(context: str, question: str) -> str:
    """The user message for a question about a document (used by ``ask``, the benchmarks and training)."""
    return f"{context.strip()}\n\n{question.strip()}"
