"""``maskkv pull`` (fetch a checkpoint from the Hugging Face Hub) and ``maskkv models`` (what is on this machine);
the offer to pull a ``--model ORG/NAME`` that is not on disk yet is in ``cli/model_choice.py``."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maskkv_cli.cli.common import fail, guarded, print_wide, report_console
from maskkv_cli.cli.model_choice import run_pull
from maskkv_cli.cli.options import JsonOpt, QuietOpt
from maskkv_cli.runtime.sizes import human_size


@guarded
def pull(
    repo_id: Annotated[str, typer.Argument(help="Hugging Face model id, ORG/NAME, or its page's address "
                                           "(https://huggingface.co/ORG/NAME[/tree/REVISION]).", show_default=False)],
    revision: Annotated[str | None, typer.Option("--revision", "-r", help="Branch, tag or commit [default: main].",
                                                 show_default=False)] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Download a checkpoint from the Hugging Face Hub into the local HF cache, where `--model ORG/NAME` finds it.

    Only what maskkv reads is fetched: config.json, generation_config.json, tokenizer files, the chat template
    and the safetensors weights (never remote code, never .bin/.pth). Files already cached are skipped, so an
    interrupted pull continues where it stopped. HF_TOKEN (gated models), HF_ENDPOINT (a mirror),
    HF_HUB_OFFLINE (cache only) and HF_HUB_CACHE / HF_HOME (where) are respected.

    Examples:

        maskkv pull GSAI-ML/LLaDA-8B-Instruct

        maskkv pull Dream-org/Dream-v0-Instruct-7B --revision main

        HF_TOKEN=hf_... maskkv pull GSAI-ML/LLaDA-1.5

        maskkv pull https://huggingface.co/GSAI-ML/LLaDA-8B-Instruct
    """
    from maskkv_cli.models.hub import parse_repo

    repo_id, in_address = parse_repo(repo_id)
    if in_address and revision and in_address != revision:
        raise fail(f"the address names revision {in_address} and --revision {revision}; give one", 2)
    revision = revision or in_address
    result = run_pull(repo_id, revision, quiet, as_json)
    from maskkv_cli.models.catalog import inspect

    checked = inspect(result.path, repo_id, "hf-cache")  # whether it loads, from the files' headers
    if as_json:
        typer.echo(json.dumps({"repo_id": result.repo_id, "revision": result.revision, "commit": result.commit,
                               "path": str(result.path), "downloaded_bytes": result.fetched_bytes,
                               "offline": result.offline, "note": result.note or None,
                               "family": checked.family, "loads": checked.loadable, "problem": checked.problem,
                               "unread": checked.note,
                               "files": [{"name": f.name, "size": f.size} for f in result.files]}))
        return
    if result.offline:
        what = result.note
    elif result.fetched_bytes:
        what = f"downloaded {human_size(result.fetched_bytes)}"
    else:
        what = "already in the cache, nothing downloaded"
    if not quiet:
        typer.echo(f"{repo_id} ({result.commit[:12]}): {what}", err=True)
        if not checked.loadable:
            typer.echo(f"it does not load: {checked.problem}", err=True)
        elif checked.note:
            typer.echo(f"{checked.family}: {checked.note}", err=True)
        typer.echo(f"use it with --model {repo_id}" + (f" (revision {revision}: --model {result.path})"
                                                       if revision and revision != "main" else ""), err=True)
    typer.echo(str(result.path))


@guarded
def models(as_json: JsonOpt = False) -> None:
    """List the checkpoints on this machine: the embedded model, folders given to --model before, and models
    in the Hugging Face cache, with family, size, dtype and whether each loads (or why not).

    Examples:

        maskkv models

        maskkv models --json
    """
    from maskkv_cli.models.catalog import local_models

    found = local_models()
    if as_json:
        typer.echo(json.dumps({"models": [m.as_dict() for m in found]}))
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("model", "family", "params", "size", "dtype", "loads"):
        table.add_column(col, overflow="fold")  # a long path folds onto the next line, never cut
    for m in found:
        params = f"{m.params / 1e9:.2f}B" if m.params and m.params >= 1e8 else (f"{m.params / 1e6:.1f}M"
                                                                              if m.params else "-")
        table.add_row(m.name, m.family or "-", params, human_size(m.size_bytes), m.dtype or "-",
                      ("yes" + (f" ({m.note})" if m.note else "")) if m.loadable else f"no: {m.problem}")
    print_wide(report_console(), table)  # (piped, the loads column was cut: '…/snapsho…')
    if not any(m.source == "hf-cache" for m in found):
        from maskkv_cli.defaults import PULL_HINT

        typer.echo(f"no model in the Hugging Face cache yet: `{PULL_HINT}` fetches one", err=True)
