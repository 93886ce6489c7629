"""``maskkv ingest``, ``maskkv ask`` and ``maskkv summarize``: documents in, answers out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.commands.common import (
    cache_config,
    fail,
    generation_config,
    guarded,
    live_display_on,
    note,
    one_line_stats,
    open_session,
)
from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.options import (
    AlgOpt,
    BlockOpt,
    BudgetOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    GenLengthOpt,
    JsonOpt,
    LayerBudgetsOpt,
    LongOpt,
    ModelOpt,
    PasswordOpt,
    PolicyOpt,
    QuietOpt,
    RatioOpt,
    SeedOpt,
    StepsOpt,
    TemperatureOpt,
    ThresholdOpt,
    TopKOpt,
    TopPOpt,
)


def _consoles(quiet: bool, as_json: bool) -> tuple[Any, bool]:
    from rich.console import Console

    err = Console(stderr=True)
    return err, live_display_on(quiet, as_json)


def _warn(doc: Any, quiet: bool, as_json: bool) -> None:
    for w in doc.warnings:
        note(w, quiet, as_json)


@guarded
def ingest(
    files: Annotated[list[Path] | None, typer.Argument(help="PDF, text or Markdown files.", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Count tokens with this model's tokenizer "
                                              "(default: tiktoken if cached locally, else an estimate).",
                                              show_default=False)] = None,
    password: PasswordOpt = None,
    list_: Annotated[bool, typer.Option("--list", help="List the documents in the store.")] = False,
    remove: Annotated[str | None, typer.Option("--remove", help="Remove a document (sha prefix or file name).",
                                               show_default=False)] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Parse documents once and keep them in the local store (``MASKKV_HOME``) for later commands.

    Examples:

        maskkv ingest report.pdf notes.md

        maskkv ingest --list

        maskkv ingest --remove report.pdf
    """
    from maskkv_cli.store import DocumentStore

    store = DocumentStore()
    if list_:
        entries = store.list()
        if as_json:
            typer.echo(json.dumps({"documents": [{"sha256": e.sha256, "source": e.source, "kind": e.kind,
                                                  "pages": e.pages, "chars": e.chars,
                                                  "ingested_at": e.ingested_at} for e in entries]}))
            return
        if not entries:
            typer.echo(f"the store is empty ({store.root})")
        for e in entries:
            typer.echo(f"{e.sha256[:12]}  {e.pages:4d} pages  {e.chars:9d} chars  {e.source}")
        return
    if remove:
        entry = store.remove(remove)
        done = f"removed {entry.source} ({entry.sha256[:12]})"
        typer.echo(json.dumps({"removed": entry.sha256}) if as_json else done)
        return
    if not files:
        raise fail("give one or more files to ingest, or --list / --remove", 2)
    tokenizer = None
    if model:
        from maskkv_cli.defaults import resolve_default_model
        from maskkv_cli.prompting import load_tokenizer

        tokenizer = load_tokenizer(resolve_default_model(model)[0])
    import warnings

    from maskkv_cli.tokencount import TokenCountWarning, count_tokens

    warnings.simplefilter("ignore", TokenCountWarning)  # the method is reported in each row instead
    rows = []
    for f in files:
        doc, cached = store.ingest(f, password=password)
        _warn(doc, quiet, as_json)
        tokens, method = count_tokens(doc.text, tokenizer)
        rows.append({"source": str(f), "sha256": doc.sha256, "kind": doc.kind, "pages": len(doc.pages),
                     "chars": doc.n_chars, "tokens": tokens, "token_method": method, "cached": cached,
                     "warnings": list(doc.warnings)})
        if not as_json:
            state = "already in the store" if cached else "stored"
            typer.echo(f"{f}: {len(doc.pages)} pages, {doc.n_chars} chars, {tokens} tokens ({method}); {state} "
                       f"as {doc.sha256[:12]}")
    if as_json:
        typer.echo(json.dumps({"documents": rows}))


def _questions(question: str | None, extra: list[str] | None, questions_file: Path | None) -> list[str]:
    qs = ([question] if question is not None else []) + list(extra or [])
    if questions_file is not None:
        try:
            text = questions_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise fail(f"cannot read --questions file {questions_file}: {exc}", 2) from None
        qs += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not qs:
        raise fail("no question given: pass QUESTION, -q QUESTION or --questions FILE", 2)
    for q in qs:
        if not q.strip():
            raise fail("a question is empty; write the question after the document", 2)
    return qs


@guarded
def ask(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    question: Annotated[str | None, typer.Argument(help="The question.", show_default=False)] = None,
    more: Annotated[list[str] | None, typer.Option("--question", "-q", help="More questions (repeatable); the "
                                                   "document is parsed and the model loaded once.",
                                                   show_default=False)] = None,
    questions_file: Annotated[Path | None, typer.Option("--questions", help="A file with one question per line.",
                                                        show_default=False)] = None,
    model: ModelOpt = None,
    policy: PolicyOpt = DEFAULT_POLICY,
    layer_budgets: LayerBudgetsOpt = "auto",
    budget: BudgetOpt = None,
    ratio: RatioOpt = None,
    gen_length: GenLengthOpt = None,
    steps: StepsOpt = None,
    block_length: BlockOpt = None,
    temperature: TemperatureOpt = 0.0,
    threshold: ThresholdOpt = None,
    alg: AlgOpt = "entropy",
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    long: LongOpt = "truncate",
    password: PasswordOpt = None,
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    dtype: DtypeOpt = "auto",
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Answer questions about a document with the KV cache compressed by MaskKV (or --policy).

    Examples:

        maskkv ask report.pdf "What does the report conclude?"

        maskkv ask report.pdf -q "Who wrote it?" -q "When?" --budget 128

        maskkv ask book.txt "Where is the treasure?" --long rope-scale --json
    """
    from maskkv_cli.store import DocumentStore

    qs = _questions(question, more, questions_file)
    cache = cache_config(policy, budget, ratio, seed, layer_budgets)
    err, live_on = _consoles(quiet, as_json)
    from maskkv_cli.render import LiveRun

    with LiveRun(err, live_on, device if device != "auto" else "cpu") as live:
        live.phase("parse", str(document))
        doc, _ = DocumentStore().ingest(document, password=password)
        _warn(doc, quiet, as_json)
        live.phase("load model")
        session = open_session(model, device, dtype, quiet, as_json, device_map)
        session.dream_options = {"alg": alg, "top_p": top_p, "top_k": top_k}
        gen = generation_config(session.generation_defaults, gen_length, steps, block_length,
                                temperature=temperature, threshold=threshold, seed=seed)
        results = []
        shown: set[str] = set()
        for i, q in enumerate(qs, 1):
            live.phase("tokenize", f"question {i}/{len(qs)}")
            answer, fitted = answer_question(session, doc.text, q, gen, cache, long, live)
            for message in [fitted.rule, *answer.notes]:
                if message and message not in shown:
                    shown.add(message)
                    note(message, quiet, as_json)
            results.append((q, answer, fitted))
    if as_json:
        typer.echo(json.dumps({
            "document": {"source": str(document), "sha256": doc.sha256, "pages": len(doc.pages),
                         "chars": doc.n_chars},
            "model": session.model_path,
            "answers": [{"question": q, "answer": a.text, "policy": cache.policy, "budget": a.budget,
                         "prompt_tokens": a.prompt_len, "dropped_tokens": f.dropped, "rope_factor": f.rope_factor,
                         "stats": a.result.stats.as_dict()} for q, a, f in results],
        }))
        return
    for q, a, _ in results:
        if len(results) > 1:
            typer.echo(f"Q: {q}")
            typer.echo(f"A: {a.text}\n")
        else:
            typer.echo(a.text)
        if not quiet:
            typer.echo(one_line_stats(a.result.stats), err=True)


def answer_question(session: Any, context: str, question: str, gen: Any, cache: Any, long: str,
                    live: Any) -> tuple[Any, Any]:
    """Fit the document to the window, build the prompt, run the engine."""
    from maskkv_cli.longctx import fit_context
    from maskkv_cli.prompting import document_question

    cfg = session.model.config
    room = session.window - session.prompt_overhead(question) - gen.gen_length
    total = session.prompt_overhead(question) + session.count_tokens(context) + gen.gen_length
    fitted = fit_context(session.tokenizer, context, room, long, cfg.head_dim, session.base_theta, session.window,
                         total)
    session.set_rope_factor(fitted.rope_factor)
    ids = session.prompt_ids(document_question(fitted.text, question))
    live.phase("prefill", f"{len(ids)} prompt tokens")
    answer = session.answer_ids(ids, gen, cache, on_event=live)
    stats = answer.result.stats
    if stats.kv_bytes:
        from maskkv_cli.render import human_bytes

        live.set_cache(f"{human_bytes(stats.kv_bytes)} kept of {human_bytes(stats.kv_full_bytes)}")
    return answer, fitted


@guarded
def summarize(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    length: Annotated[int, typer.Option("--length", help="Target length of the summary in words.")] = 150,
    model: ModelOpt = None,
    policy: PolicyOpt = DEFAULT_POLICY,
    layer_budgets: LayerBudgetsOpt = "auto",
    budget: BudgetOpt = None,
    ratio: RatioOpt = None,
    steps: StepsOpt = None,
    block_length: BlockOpt = None,
    temperature: TemperatureOpt = 0.0,
    threshold: ThresholdOpt = None,
    alg: AlgOpt = "entropy",
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    password: PasswordOpt = None,
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    dtype: DtypeOpt = "auto",
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document of any length: summarize parts (whole pages), then the summaries.

    Examples:

        maskkv summarize report.pdf

        maskkv summarize book.txt --length 300 --budget 128 --json
    """
    from maskkv_cli.render import LiveRun
    from maskkv_cli.store import DocumentStore
    from maskkv_cli.summarize import merge_instruction, part_instruction, split_parts

    if length <= 0:
        raise fail(f"--length must be a positive number of words, got {length}", 2)
    cache = cache_config(policy, budget, ratio, seed, layer_budgets)
    err, live_on = _consoles(quiet, as_json)
    with LiveRun(err, live_on, device if device != "auto" else "cpu") as live:
        live.phase("parse", str(document))
        doc, _ = DocumentStore().ingest(document, password=password)
        _warn(doc, quiet, as_json)
        live.phase("load model")
        session = open_session(model, device, dtype, quiet, as_json, device_map)
        session.dream_options = {"alg": alg, "top_p": top_p, "top_k": top_k}
        if session.summary_length:
            # a model trained on lead summaries (the embedded one) writes them at the length it was trained on
            gen_tokens = session.summary_length
            block = block_length or gen_tokens
        else:
            block = block_length or 32
            gen_tokens = max(block, -(-int(length * 1.6) // block) * block)
        gen = generation_config({}, gen_tokens, steps, block, temperature=temperature, threshold=threshold,
                                seed=seed)
        room = session.window - session.prompt_overhead(part_instruction(length)) - gen.gen_length
        if room < 64:
            raise fail(f"--length {length} leaves no room for the document in the {session.window}-token window", 2)
        parts = split_parts(doc, session.count_tokens, room)
        summaries = []
        for i, part in enumerate(parts, 1):
            live.phase(f"part {i}/{len(parts)}", f"pages {part.first_page}-{part.last_page}")
            if not quiet and not as_json and not live_on:
                typer.echo(f"part {i}/{len(parts)} (pages {part.first_page}-{part.last_page}, {part.tokens} tokens)",
                           err=True)
            a, _ = answer_question(session, part.text, part_instruction(length), gen, cache, "truncate", live)
            summaries.append({"pages": [part.first_page, part.last_page], "tokens": part.tokens, "summary": a.text})
        final = summaries[0]["summary"]
        if len(summaries) > 1:
            live.phase("merge", f"{len(summaries)} summaries")
            joined = "\n\n".join(s["summary"] for s in summaries)
            # a lead-summary model is asked for the lead of the joined summaries (the document's first sentences),
            # the one summary format it was trained on
            merge = part_instruction(length) if session.summary_length else merge_instruction(length)
            final = answer_question(session, joined, merge, gen, cache, "truncate", live)[0].text
    if as_json:
        typer.echo(json.dumps({"document": str(document), "pages": len(doc.pages), "summary": final,
                               "parts": summaries}))
        return
    typer.echo(final)
