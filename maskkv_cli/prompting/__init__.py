"""From a document and a question to prompt ids: tokenizer, chat template, fitting to the window, summary parts."""

from maskkv_cli.prompting.chat import (
    NO_ANSWER,
    chat_prompt_ids,
    decode_answer,
    document_question,
    llada_template,
    load_tokenizer,
    stop_ids,
)

__all__ = ["NO_ANSWER", "chat_prompt_ids", "decode_answer", "document_question", "llada_template", "load_tokenizer",
           "stop_ids"]
