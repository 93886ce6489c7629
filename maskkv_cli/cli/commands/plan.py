"""``maskkv plan``: the memory a model needs by context length, weight format and cache policy, and which GPU sizes
it fits (``engine/memory_table.py``), from its config alone."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from maskkv_cli.cli.common import guarded, print_wide, report_console
from maskkv_cli.cli.options import JsonOpt, budgets_option, gen_length_option, model_option, quantize_option
from maskkv_cli.cli.parsing import parse_counts, split_list

GIB = 1 << 30


def _notes(model: Any, rows: list[Any]) -> list[str]:
    from maskkv_cli.engine.chunks import QUERY_CHUNK
    from maskkv_cli.engine.memory_table import RESERVE
    from maskkv_cli.models.diffusion_gemma_config import ENCODER_CHUNK

    lines = [f"an estimate from the config ({model.source}); no weights were read. docs/performance.md works the "
             "terms out by hand",
             f"fits: total + {RESERVE / GIB:.0f} GiB (CUDA context, workspaces) within the GPU's memory; one "
             "sequence (a batch adds the cache and step per sequence)"]
    if model.family == "diffusion_gemma":
        own = getattr(model.config, "family_config", None) or model.config
        cut = ("with MaskKV it runs layer by layer, the first step's votes cutting each full layer before the next is "
               "encoded (the prompt's hidden states and one whole full layer at the peak, never the whole cache)"
               if own.cuts_layer_by_layer else "the whole prompt cache is held until the first step's votes cut the "
               "full layers (layer by layer would hold more for this shape: its hidden state is as wide as its full "
               "layers' entries together)")
        lines.append(f"DiffusionGemma: the encoder runs in {ENCODER_CHUNK}-token chunks, its attention masked in "
                     f"bounded blocks by kernels that form no score matrix; {cut}; sliding layers keep at most "
                     "window - 1 entries; a document kept for more questions holds its whole cache besides")
    else:
        lines.append(f"activations include one {QUERY_CHUNK}-query chunk's fp32 attention scores (held by a kernel "
                     "that forms them; flash kernels do not)")
    if any(r.policy == "maskkv" and r.budget is not None and r.budget < r.prompt for r in rows):
        lines.append("maskkv rows keep the budget per head on average; the engine pads each layer's cache to its "
                     "longest head (one attention call a layer), so heads of uneven budgets hold more: up to the "
                     "longest head's budget x heads a layer (1.5x the average on the embedded model; "
                     "docs/performance.md, Ragged heads)")
    if any(r.format == "int4" and r.weights_implemented for r in rows):
        lines.append("int4: the bytes of the CPU's packing (models/quantize.py); on a GPU maskkv packs int4 for "
                     "PyTorch's tinygemm kernel (tile_packed_to_4d, bf16 only), whose bytes are not measured here")
    if any(not r.weights_implemented for r in rows):
        lines.append("*: the format's rules applied to this model's shapes; maskkv cannot load it so yet")
    if any(r.over_window for r in rows):
        lines.append(f"!: longer than the model's {model.max_positions:,} positions")
    return lines


def _print(model: Any, rows: list[Any], sizes: tuple[int, ...]) -> None:
    from rich import box
    from rich.table import Table

    console = report_console()
    gen = rows[0].gen_length
    table = Table(title=f"maskkv plan: {model.name} ({gen}-token response, GiB)", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for name in ("context", "format", "cache", "weights", "KV kept", "KV at peak", "activations", "total",
                 *(f"{s} GiB" for s in sizes)):
        table.add_column(name, justify="left" if name in ("format", "cache") else "right", no_wrap=True)
    for r in rows:
        cache = "full" if r.budget is None else f"maskkv@{r.budget}"
        table.add_row(f"{r.context:,}" + ("!" if r.over_window else ""), r.format + ("" if r.weights_implemented
                                                                                    else "*"), cache,
                      *(f"{v / GIB:.2f}" for v in (r.weights, r.cache_kept, r.cache_peak, r.activations, r.total)),
                      *("yes" if r.fits[str(s)] else "no" for s in sizes))
    print_wide(console, table)
    for line in _notes(model, rows):
        typer.echo(f"  {line}")


@guarded
def plan(
    model: Annotated[str | None, model_option(
        "A named config (llada2-mini, diffusiongemma-26b-a4b, llada-8b, ...), a checkpoint folder or an ORG/NAME in "
        "the local Hugging Face cache: only its config.json is read [default: MASKKV_MODEL or the config file's "
        "model].", "-m", show_default=False)] = None,
    context: Annotated[str, typer.Option(
        "--context", help="Context lengths in tokens (prompt + response), separated by commas; k = 1024, so "
        "256k is 262,144.")]
    = "8k,32k",
    quantize: Annotated[str, quantize_option(
        "Weight formats, separated by commas: bf16, fp16, fp32 (unquantized), int8, int4 (weight-only, the rest of "
        "the model, the cache and activations in bf16).")] = "bf16,int8,int4",
    budgets: Annotated[str, budgets_option(
        "MaskKV budgets (entries kept per KV head per evicted layer, on average), separated by commas; every "
        "context also gets a row with the full cache.")] = "256",
    gen_length: Annotated[int | None, gen_length_option(
        "Response tokens within the context [default: DiffusionGemma one canvas (256), else 128].", "-n",
        show_default=False)] = None,
    gpu_sizes: Annotated[str, typer.Option(
        "--gpu-sizes", help="GPU memory sizes in GiB to check, separated by commas.")] = "16,24,32,80",
    as_json: JsonOpt = False,
) -> None:
    """Estimate the memory of one sequence: weights, prompt KV cache and activations at the peak, by context length,
    weight format and cache policy (full, MaskKV at each budget), and which GPU sizes it fits. From the config
    alone (no weights are read, nothing runs); `maskkv bench memory` measures real runs instead.

    Examples:

        maskkv plan --model llada2-mini

        maskkv plan --model diffusiongemma-26b-a4b --context 8k,32k,128k,256k

        maskkv plan -m ~/models/LLaDA2.1-mini --quantize bf16,int4 --budgets 64,256,1024 --json
    """
    from maskkv_cli.defaults import configured_model, model_origin
    from maskkv_cli.engine.memory_table import memory_table, parse_formats, resolve_plan_model, row_dict
    from maskkv_cli.errors import MaskKVError, UsageError

    name = model or configured_model()
    if not name:
        raise UsageError("plan needs --model: a named config (e.g. llada2-mini, diffusiongemma-26b-a4b), a checkpoint "
                         "folder or an ORG/NAME in the local cache")
    sizes = parse_counts(gpu_sizes, "--gpu-sizes", unique=True, example="24,80")
    if any(s > 1 << 20 for s in sizes):
        raise UsageError("--gpu-sizes are in GiB, e.g. 16,24,80")
    try:
        chosen = resolve_plan_model(name)
    except MaskKVError as exc:  # a default set elsewhere is named where it was set
        origin = None if model else model_origin()
        if origin is None:
            raise
        raise type(exc)(f"{origin} names no model plan can read ({exc}); fix it, or pass --model") from None
    rows = memory_table(chosen, list(parse_counts(context, "--context", unique=True, example="8k,32k")),
                        parse_formats(list(dict.fromkeys(split_list(quantize)))) if quantize.strip() else [],
                        list(parse_counts(budgets, "--budgets", unique=True)), gen_length, sizes)
    if not rows:
        raise UsageError("--quantize is empty; give e.g. --quantize bf16,int8")
    if as_json:
        typer.echo(json.dumps({"model": chosen.name, "source": chosen.source, "family": chosen.family,
                               "estimate": True, "gpu_sizes_gib": list(sizes), "notes": _notes(chosen, rows),
                               "rows": [row_dict(r) for r in rows]}))
        return
    _print(chosen, rows, sizes)
