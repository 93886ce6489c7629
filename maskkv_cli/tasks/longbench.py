"""LongBench v1 prompts for ``bench quality --tasks FILE.jsonl``: per-task templates, answer lengths, truncation.

The official harness (LongBench v1's own prediction script; docs/evaluation.md) fills a per-task template with
``{context}`` and ``{input}``, tokenizes it, keeps the first and the last half of the tokens when it is longer
than the limit, and only then wraps it in the chat template, except for the few-shot and code tasks (trec,
triviaqa, samsum, lsht, lcc, repobench-p), which stay raw text. Each task has its own number of new tokens (32 to 512).

The answer lengths and the raw/chat split are the harness's; the template *wording* here is ours, written to the
harness's structure (instruction, context, instruction again, question, "Answer:"). A user who has the official
``dataset2prompt.json`` can pass it with ``--prompts`` to use its exact wording.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskkv_cli.errors import UsageError, reason
from maskkv_cli.prompting.fit import middle_cut
from maskkv_cli.tasks.metrics import resolve_dataset
from maskkv_cli.tasks.taskio import Task

MAX_NEW_TOKENS: dict[str, int] = {
    **dict.fromkeys(("hotpotqa", "2wikimqa", "musique", "triviaqa", "passage_count", "passage_retrieval_en",
                     "passage_retrieval_zh"), 32),
    **dict.fromkeys(("multifieldqa_en", "multifieldqa_zh", "trec", "lsht", "lcc", "repobench-p"), 64),
    **dict.fromkeys(("narrativeqa", "qasper", "dureader", "samsum"), 128),
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "vcsum"), 512),
}
RAW_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

_SHORT = "Give only the answer, in as few words as possible, with no explanation."
_MULTI_DOC = ("Answer the question using the passages below. " + _SHORT + "\n\nPassages:\n{context}\n\n"
              "Using the passages above, answer the question. " + _SHORT + "\n\nQuestion: {input}\nAnswer:")
_ZH_QA = ("阅读下面的{what}，回答问题，用尽量少的字。\n\n{what}：{{context}}\n\n"
          "请根据上面的{what}回答问题，用尽量少的字，不要解释。\n\n问题：{{input}}\n回答：")

TEMPLATES: dict[str, str] = {
    "narrativeqa": "Read the story below and answer the question about it. " + _SHORT + "\n\nStory: {context}\n\n"
                   "Now answer the question about the story. " + _SHORT + "\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "Read the scientific article below and answer the question about it in a phrase or a sentence. "
              'Write "unanswerable" if the article does not answer it; answer a yes/no question with "yes", "no" '
              'or "unanswerable".\n\nArticle: {context}\n\nNow answer the question about the article in a phrase '
              'or a sentence, "unanswerable" if the article does not answer it; answer a yes/no question with '
              '"yes", "no" or "unanswerable".\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the text below and answer the question about it. " + _SHORT + "\n\n{context}\n\n"
                       "Now answer the question about the text above. " + _SHORT + "\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": _ZH_QA.format(what="文字"),
    "hotpotqa": _MULTI_DOC,
    "2wikimqa": _MULTI_DOC,
    "musique": _MULTI_DOC,
    "dureader": _ZH_QA.format(what="文章"),
    "gov_report": "Below is a report by a government agency. Write a one-page summary of it.\n\nReport:\n{context}"
                  "\n\nNow write a one-page summary of the report above.\n\nSummary:",
    "qmsum": "Below is the transcript of a meeting and a query about it. Answer the query in one or more "
             "sentences.\n\nTranscript:\n{context}\n\nNow answer the query about the transcript above in one or more "
             "sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "Below are several news articles. Write a one-page summary of them all.\n\nArticles:\n{context}"
                  "\n\nNow write a one-page summary of all the articles above.\n\nSummary:",
    "vcsum": "下面是一次会议的记录。请写一份会议总结。\n\n会议记录：\n{context}\n\n"
             "请为上面的会议写一份总结。\n\n会议总结：",
    "trec": "Say which type the question is, as in the examples below.\n\n{context}\n{input}",
    "triviaqa": "Answer the question from the passage, as in the examples below. Give only the answer.\n\n{context}"
                "\n\n{input}",
    "samsum": "Summarize the dialogue in a sentence or two, as in the examples below.\n\n{context}\n\n{input}",
    "lsht": "请判断下面新闻的类别，参照这些例子。\n\n{context}\n{input}",
    "passage_count": "Below are several paragraphs; some are copies of others. How many different paragraphs are "
                     "there?\n\n{context}\n\nCount the different paragraphs above, a repeated one only once. Give "
                     'only the number, like "The answer is: 5".\n\nThe answer is: ',
    "passage_retrieval_en": "Below are numbered paragraphs and then a summary of one of them. Which paragraph is "
                            'summarized?\n\n{context}\n\nSummary: {input}\n\nWhich paragraph does the summary come '
                            'from? Answer with its label only, like "Paragraph 1".\n\nThe answer is: ',
    "passage_retrieval_zh": "下面是若干编号的段落，以及其中一段的摘要。请判断摘要出自哪一段。\n\n"
                            "{context}\n\n摘要：{input}\n\n"
                            "摘要出自哪一段？只写出段落编号，如“段落1”。\n\n答案是：",
    "lcc": "Complete the code below.\n{context}Next line of code:\n",
    "repobench-p": "Complete the code below.\n{context}{input}Next line of code:\n",
}


@dataclass(frozen=True)
class PromptSpec:
    """How the prompts of one LongBench task are built."""

    dataset: str  # the base task (``hotpotqa`` for ``hotpotqa_e``)
    template: str  # with ``{context}`` and (usually) ``{input}``
    max_new_tokens: int
    chat: bool  # wrap in the chat template after truncation (False: raw text after BOS)

    @property
    def fingerprint(self) -> str:
        """Changes when the prompt changes: part of a result row's key."""
        text = json.dumps([self.template, self.max_new_tokens, self.chat])
        return "longbench:" + hashlib.sha256(text.encode()).hexdigest()[:12]


def load_templates(path: str | Path) -> dict[str, str]:
    """A JSON object ``{dataset: template}`` (the official ``dataset2prompt.json`` has this form)."""
    source = Path(path).expanduser()
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--prompts file {source} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --prompts file {source}: {reason(exc)}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--prompts file {source} is not JSON ({exc.msg}, line {exc.lineno}); expected an "
                         'object like {"hotpotqa": "...{context}...{input}..."}') from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise UsageError(f"--prompts file {source} must be a JSON object of dataset name to template text")
    for name, template in data.items():
        if "{context}" not in template:
            raise UsageError(f"--prompts: the template of {name!r} has no {{context}} placeholder")
        try:
            template.format(context="", input="")
        except (KeyError, IndexError, ValueError) as exc:
            raise UsageError(f"--prompts: the template of {name!r} cannot be filled ({exc!r}); only {{context}} "
                             "and {input} may appear in braces (write {{ and }} for literal braces)") from None
    return data


def prompt_spec(dataset: str, templates: Mapping[str, str] | None = None) -> PromptSpec | None:
    """The prompt rules of a LongBench task (``_e`` names included); None for other datasets."""
    base = resolve_dataset(dataset)
    if base not in MAX_NEW_TOKENS:
        return None
    chosen = (templates or {}).get(dataset) or (templates or {}).get(base) or TEMPLATES[base]
    return PromptSpec(base, chosen, MAX_NEW_TOKENS[base], base not in RAW_DATASETS)


def encode_longbench(session: Any, tasks: Sequence[Task], spec: PromptSpec,
                     gen_length: int) -> tuple[list[list[int]], int]:
    """Prompt ids for each task by the harness's rules, fitted to the model's window; and how many were cut."""
    from maskkv_cli.prompting import chat_prompt_ids

    tok = session.tokenizer
    bos = session.model.config.bos_token_id
    overhead = len(chat_prompt_ids(tok, "")) if spec.chat else int(bos is not None)
    limit = session.window - session.response_positions(gen_length) - overhead
    if limit <= 0:
        raise UsageError(f"{spec.dataset}: {gen_length} new tokens leave no room for a prompt in the model's "
                         f"{session.window}-token window; give a smaller --gen-length")
    prompts: list[list[int]] = []
    cut = 0
    for task in tasks:
        text = spec.template.format(context=task.context, input=task.input)
        ids = list(tok.encode(text, add_special_tokens=False))
        cut += len(ids) > limit
        target = limit
        for _ in range(4):  # decoding and re-encoding at the cut may merge tokens differently: cut again
            if len(ids) <= limit:
                break
            text = tok.decode(middle_cut(ids, target), skip_special_tokens=True)
            again = list(tok.encode(text, add_special_tokens=False))
            target -= max(0, len(again) - limit)
            ids = again
        if spec.chat:
            prompts.append(chat_prompt_ids(tok, text))
        else:
            prompts.append(([bos] if bos is not None else []) + ids)  # ids: the tokens of ``text`` as it stands
    return prompts, cut
