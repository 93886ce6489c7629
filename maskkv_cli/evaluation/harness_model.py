"""``MaskKVLM``: maskkv as an lm-evaluation-harness model (``--model maskkv``).

Model args (``--model_args key=value,...``): ``model`` (checkpoint folder; default as the commands choose it:
MASKKV_MODEL, the config file, else the embedded tiny model), every shared run setting by its name
(``run_settings.RunSettings``: ``policy``, ``budget`` or ``ratio``, ``layer_budgets``, ``steps`` (per answer; default
one token per step), ``block_length`` (default 32), ``remasking``, ``threshold``, ``cfg``, ``alg``, ``top_p``,
``top_k``, LLaDA2's ``editing_threshold`` and ``max_post_steps``, ``seed``), ``device``, ``dtype``, ``quantize`` (none,
int8, int4: the weights' quantization; default ``MASKKV_QUANTIZE`` or the config file's, else none), ``max_gen_toks``
(for requests that name none), ``mc_samples`` and ``mc_batch`` (log-likelihood estimate), ``stats_dir`` (where the
per-request statistics go), ``batch_size`` (``generate_until`` requests denoised together: a number, or ``auto``, the
default: the most that fit free memory by the memory model, at most ``max_batch_size``; the harness's own
``--batch_size`` arrives here too).

Requests: ``generate_until`` runs the sampler under the cache policy with the request's ``max_gen_toks`` as the
answer length and cuts the answer at the first of its ``until`` strings; greedy unless the request asks for
``do_sample`` with a temperature. Requests with the same answer length and temperature run in batches
(``Session.answer_many``), each answer the one it gets alone, every family alike; a block-causal model (LLaDA2)
computes the document a request shares with the one before it once. ``loglikelihood`` uses
the Monte Carlo estimate of ``likelihood.py``; ``loglikelihood_rolling`` (perplexity tasks) is refused with a
one-line error.

Data parallel: under ``accelerate launch`` each process is one rank with its own model on its own device; the
harness gives each rank its share of the documents (``rank``, ``world_size``) and gathers the results.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from maskkv_cli.evaluation import engine_adapter
from maskkv_cli.evaluation.likelihood import continuation_logprob
from maskkv_cli.evaluation.request_stats import summarize, summary_line, unique_lines, write_stats

log = logging.getLogger("maskkv.evaluation")

DEFAULT_MAX_GEN_TOKS = 256
UNSUPPORTED_ROLLING = ("maskkv supports generate_until and loglikelihood requests (generation and multiple-choice "
                       "tasks), not loglikelihood_rolling (perplexity tasks)")


def finish_distributed() -> None:
    """Destroy the process group that ``accelerate launch`` started, once a run has ended normally (every rank past
    its last collective). Left to the interpreter's exit, gloo's worker threads can be torn down still joinable and
    the rank aborts ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489); after an
    error it is left alone, since another rank may still be waiting in a collective."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _optional_int(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return int(value)


@dataclass(frozen=True)
class Generation:
    """One ``generate_until`` request as the engine takes it."""

    ids: list[int]  # the prompt's token ids (before fitting the window)
    length: int  # answer tokens (``max_gen_toks``)
    temperature: float  # 0: greedy
    until: Any  # stop strings: a string or a list of them


def cut_at_stops(text: str, until: Any) -> str:
    """``text`` up to the first occurrence of any stop string (``until``: a string or a list of them)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    end = len(text)
    for stop in stops:
        if stop:
            at = text.find(stop)
            if at != -1:
                end = min(end, at)
    return text[:end]


@register_model("maskkv")
class MaskKVLM(LM):
    """A diffusion LM (any family maskkv loads) whose prompt K/V cache is kept by a maskkv policy."""

    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | None = None,
                 quantize: str | None = None, max_gen_toks: Any = DEFAULT_MAX_GEN_TOKS, mc_samples: Any = 32,
                 mc_batch: Any = 8,
                 stats_dir: str | None = None, batch_size: Any = None, max_batch_size: Any = None,
                 progress: Any = True, **run_args: Any) -> None:
        """``run_args``: the shared run settings by name (``engine_adapter.harness_settings``)."""
        super().__init__()
        from maskkv_cli.errors import UsageError

        self.settings = engine_adapter.harness_settings(run_args)
        self.settings.cache()  # an unknown policy, budget and ratio both, a bad mode: one line before the model loads
        from maskkv_cli.defaults import resolve_quantize

        weights = resolve_quantize(None if quantize in (None, "") else str(quantize))
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = engine_adapter.batch_size_arg(batch_size)
        self.max_batch_size = _optional_int(max_batch_size)
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise UsageError(f"max_batch_size must be a positive number, got {max_batch_size!r}")
        self.batch_sizes: dict[tuple[int, float], int] = {}  # (answer length, temperature) -> its batch size
        self.mc_samples = int(mc_samples)
        if self.mc_samples < 1:  # 0 divided by zero, a negative count tied every choice
            raise UsageError(f"--mc-samples must be at least 1, got {mc_samples!r}")
        self.progress = str(progress).strip().lower() not in ("0", "false", "no", "off")  # the harness passes text
        self.mc_batch = max(1, int(mc_batch))
        self.stats_dir = stats_dir
        self.stats_stamp = datetime.now().isoformat(timespec="seconds").replace(":", "-")
        self.last_summary: dict[str, dict[str, Any]] = {}
        self.accelerator: Any = None
        target = device or "auto"
        if target.startswith("cuda") and not torch.cuda.is_available():  # the harness CLI's default is cuda:0
            log.warning("maskkv: CUDA is not available; running on the CPU")
            target = "cpu"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=target == "cpu" or not torch.cuda.is_available())
            self._rank = self.accelerator.process_index
            self._world_size = self.accelerator.num_processes
            target = str(self.accelerator.device)  # one model per device: cuda:LOCAL_RANK, or the CPU
        self.engine = engine_adapter.Engine(model, device=target, dtype=None if dtype in (None, "auto") else str(dtype),
                                            settings=self.settings, quantize=weights)
        self._device = self.engine.device
        if self.engine.note and self._rank == 0:
            log.info(self.engine.note)

    # ----- distributed protocol (used by the harness's evaluator) ------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.accelerator is None:
            return tensor
        return self.accelerator.gather(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.accelerator is None:
            return [obj]
        gathered: list[Any] | None = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    # ----- chat template -----------------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.engine.tokenizer, "chat_template", None) or "llada"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.engine.chat_text(chat_history, add_generation_prompt)

    # ----- requests ----------------------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        """Token ids of a prompt, with the BOS token in front unless the text (a chat template) brought one."""
        ids = list(self.engine.tokenizer.encode(text, add_special_tokens=False))
        bos = self.engine.bos_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def _progress(self, total: int, what: str, disable: bool = False) -> Any:
        """A progress bar on rank 0, unless the run is quiet (``progress`` off) or the harness asks for none."""
        from tqdm import tqdm

        return tqdm(total=total, desc=f"maskkv {what}", disable=disable or not self.progress or self._rank != 0,
                    file=sys.stderr)

    def _generation(self, request: Any) -> Generation:
        """A ``generate_until`` request's prompt ids and generation settings."""
        context, gen_kwargs = request.args
        kwargs = dict(gen_kwargs or {})
        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        return Generation(self._encode(context), int(kwargs.get("max_gen_toks") or self.max_gen_toks),
                          float(kwargs["temperature"]) if sample else 0.0, kwargs.get("until"))

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        asked = [self._generation(request) for request in requests]
        answers: dict[int, str] = {}
        lines: dict[int, dict[str, Any]] = {}
        bar = self._progress(len(requests), "generate_until", disable_tqdm)

        def answered(i: int, reply: engine_adapter.Reply) -> None:
            request = requests[i]
            text = cut_at_stops(reply.text, asked[i].until)
            answers[i] = text
            self.cache_hook.add_partial("generate_until", request.args, text)
            lines[i] = {"task": request.task_name, "doc_id": request.doc_id, "idx": request.idx,
                        "rank": self._rank, "policy": self.settings.policy, "prompt_tokens": reply.prompt_tokens,
                        "truncated": reply.truncated, "answer_chars": len(text), **reply.stats}
            bar.update(1)

        if self.batch_size == 1:
            for i, one in enumerate(asked):
                answered(i, engine_adapter.answer(self.engine, one.ids, one.length, self.settings, one.temperature))
        else:
            groups: dict[tuple[int, float], list[int]] = {}
            for i, one in enumerate(asked):
                groups.setdefault((one.length, one.temperature), []).append(i)
            for (length, temperature), members in groups.items():
                self._answer_group(asked, members, length, temperature, answered)
        bar.close()
        self._report([lines[i] for i in range(len(requests))])
        return [answers[i] for i in range(len(requests))]

    def _answer_group(self, asked: list[Generation], members: list[int], length: int, temperature: float,
                      answered: Callable[[int, engine_adapter.Reply], None]) -> None:
        """The requests ``members`` of ``asked`` (one answer length and temperature) in batches."""
        prompts = [asked[i].ids for i in members]
        size, note = engine_adapter.batch_size(self.engine, prompts, length, self.settings, temperature,
                                               self.batch_size, self.max_batch_size)
        self.batch_sizes[(length, temperature)] = size
        if note and self._rank == 0:
            log.info("maskkv generate_until, %d requests of max_gen_toks %d: %s", len(members), length, note)
        engine_adapter.answer_many(self.engine, prompts, length, self.settings, temperature, size,
                                   on_answer=lambda j, reply: answered(members[j], reply))

    def _report(self, lines: list[dict[str, Any]]) -> None:
        """Gather every rank's lines on rank 0; write them and the per-task summary, and log a line per task."""
        gathered = self.gather_object(lines, dst=0)
        if self._rank != 0 or gathered is None:
            return
        merged = unique_lines([line for part in gathered for line in part])
        self.last_summary = summarize(merged)
        for task, row in self.last_summary.items():
            message = summary_line(task, row)
            log.info(message)
            print(message, file=sys.stderr)
        if self.stats_dir:
            requests_path, _ = write_stats(self.stats_dir, self.stats_stamp, merged, self.last_summary)
            log.info("maskkv per-request statistics: %s", requests_path)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool]] = []
        bar = self._progress(len(requests), "loglikelihood", disable_tqdm)
        for request in requests:
            context, continuation = request.args
            moved = len(context) - len(context.rstrip())  # a context's trailing spaces belong to the continuation
            if moved:
                context, continuation = context[:-moved], context[-moved:] + continuation
            ids = self._encode(context)
            cont = list(self.engine.tokenizer.encode(continuation, add_special_tokens=False))
            value = continuation_logprob(self.engine, ids, cont, self.mc_samples, self.mc_batch, self.settings.seed)
            results.append(value)
            self.cache_hook.add_partial("loglikelihood", request.args, value)
            bar.update(1)
        bar.close()
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from maskkv_cli.errors import UsageError

        raise UsageError(UNSUPPORTED_ROLLING)
