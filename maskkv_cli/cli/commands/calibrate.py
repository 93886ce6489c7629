"""``maskkv calibrate``: measure a model's layer importance once and store it for MaskKV's layer budgets.

Heavy modules (torch, transformers, Rich) load inside the command, so ``maskkv --help`` stays light.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from maskkv_cli.cli.common import guarded, note, print_wide, report_console
from maskkv_cli.cli.options import (
    CalibrationSamplesOpt,
    DeviceOpt,
    DtypeOpt,
    GenLengthOpt,
    JsonOpt,
    MaxTokensOpt,
    ModelOpt,
    QuantizeOpt,
    QuietOpt,
    YesOpt,
)
from maskkv_cli.errors import DocumentError, UsageError
from maskkv_cli.runtime.devices import resolve_device

if TYPE_CHECKING:
    from maskkv_cli.models.calibration import ImportanceResult

DEFAULT_GEN_LENGTH = 128
DocsArg = Annotated[list[Path] | None, typer.Argument(
    metavar="DOCS", help="Text or PDF files to calibrate on. Default: the built-in English corpus.",
    show_default=False)]


def read_texts(paths: list[Path]) -> list[str]:
    """The text of each file, read as every command reads a document (``documents.reading``: PDF, text in any
    common encoding, Markdown, cleaned alike); every path is checked before any file is read."""
    from maskkv_cli.documents.reading import check_source, load_document

    for path in paths:
        check_source(path)
    texts: list[str] = []
    for path in paths:
        text = load_document(path).text
        if not text.strip():
            raise DocumentError(f"{path} contains no text")
        texts.append(text)
    return texts


def builtin_corpus() -> list[str]:
    try:
        from maskkv_cli.documents.corpus import load_corpus

        paragraphs = load_corpus()
    except (ImportError, OSError):
        paragraphs = []
    if not paragraphs:
        raise UsageError("no built-in corpus in this install; pass documents to calibrate on: "
                         "maskkv calibrate --model M report.pdf notes.txt")
    return ["\n\n".join(paragraphs)]


@guarded
def calibrate(
    docs: DocsArg = None,
    model: ModelOpt = None,
    samples: CalibrationSamplesOpt = 8,
    max_tokens: MaxTokensOpt = 2048,
    gen_length: GenLengthOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    yes: YesOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Measure the model's layer importance and save it as the calibration profile MaskKV's layer budgets use.

    Each input is a window of `--max-tokens` document tokens in the chat template with `--gen-length` masks
    after it (the shape of real inputs). The profile is stored per model under the config folder
    (`calibration/<model>-<hash>.json`) and picked up automatically by the `maskkv` policy.

    Examples:

        maskkv calibrate --model ~/models/LLaDA-8B-Instruct

        maskkv calibrate --model ~/models/LLaDA-8B-Instruct --samples 16 report.pdf notes.txt

        maskkv calibrate --model ~/models/LLaDA2.1-mini --quantize int8

    With --quantize the importance is measured on the quantized weights; the profile (one per model, used by runs
    of any quantization) records it. DiffusionGemma: each input is the prompt alone (no masks), I(l) is measured
    per full-attention layer at the first denoising step of a random canvas (the only layers MaskKV cuts).
    """
    from rich.console import Console

    from maskkv_cli.cli.model_choice import choose_model
    from maskkv_cli.defaults import resolve_quantize
    from maskkv_cli.engine.importance import measure_importance
    from maskkv_cli.models.calibration import make_profile, save_profile
    from maskkv_cli.prompting.calibration import calibration_inputs

    if samples < 1 or max_tokens < 1:
        raise UsageError("--samples and --max-tokens must be positive")
    if gen_length is not None and gen_length < 0:
        raise UsageError("--gen-length must not be negative")
    weights = resolve_quantize(quantize)
    from maskkv_cli.cli.parsing import writable_folder
    from maskkv_cli.defaults import check_dtype

    check_dtype(dtype)  # before the model is chosen and the inputs tokenized
    from maskkv_cli.models.calibration import profile_dir

    writable_folder(profile_dir(), "the calibration profile", "set MASKKV_CONFIG to a file in a folder you can "
                    "write (profiles are kept beside it)")  # before the measurement, not after it
    checkpoint = choose_model(model, yes, quiet, as_json)  # an ORG/NAME not here: pulled with --yes or consent
    texts = read_texts(docs) if docs else builtin_corpus()

    import torch

    from maskkv_cli.models.config import read_model_defaults
    from maskkv_cli.models.families import family
    from maskkv_cli.models.loading import load_checkpoint
    from maskkv_cli.prompting.chat import tokenizer_from_folder, use_chat_format

    folder, cfg = checkpoint.path, checkpoint.config
    canvas = cfg.family_config is not None  # DiffusionGemma: the prompt alone, then a random canvas
    if gen_length is None:
        gen_length = 0 if canvas else _default_gen_length(folder)
    tokenizer = use_chat_format(tokenizer_from_folder(folder), family(cfg.family).chat_format)
    # a block-causal model is measured as it runs: in blocks (its stored block length, else 32)
    block = read_model_defaults(folder).generation.get("block_length", 32) if cfg.block_causal else None
    inputs = calibration_inputs(tokenizer, texts, max_tokens, samples, 0 if canvas else gen_length,
                                cfg.mask_token_id)
    longest = max(len(seq) for seq in inputs)
    if longest > cfg.max_sequence_length:  # measured where the model was never trained: said, not refused
        note(f"inputs of up to {longest} tokens (template, text and masks) are longer than the model's "
             f"{cfg.max_sequence_length}-token window; the importance measured there may not be the model's: a "
             f"smaller --max-tokens keeps them within it", quiet, as_json)
    llada = load_checkpoint(folder, cfg, device=resolve_device(device), dtype=None if dtype == "auto" else dtype,
                            quantize=weights, prequantized=checkpoint.prequantized)
    batches = (torch.tensor([seq], dtype=torch.long) for seq in inputs)

    def measure(on_batch: Callable[[int, int], None] | None = None) -> ImportanceResult:
        if canvas:
            from maskkv_cli.sampling.diffusion_gemma_importance import measure_full_layer_importance

            return measure_full_layer_importance(llada, batches, on_input=on_batch)  # type: ignore[arg-type]
        return measure_importance(llada, batches, on_batch=on_batch, block=block)

    err = Console(stderr=True)
    if err.is_terminal and not quiet and not as_json:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("[bold]calibrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as progress:
            task = progress.add_task("calibrating", total=len(inputs))
            result = measure(lambda n, _t: progress.update(task, completed=n))
    else:
        result = measure()
    profile = make_profile(checkpoint, result, weights)
    saved = save_profile(profile)

    if as_json:
        typer.echo(json.dumps({**profile.to_dict(), "path": str(saved)}))
        return
    _print_table(profile.importance, result.inputs, result.tokens, cfg.evicted_layers,
                 "canvas tokens (each input's prompt encoded, then one random canvas)" if canvas else "tokens")
    typer.echo(f"saved calibration profile to {saved}")


def _default_gen_length(folder: Path) -> int:
    """The model's own default response length when it declares one, else 128."""
    from maskkv_cli.models.config import read_model_defaults

    return read_model_defaults(folder).generation.get("gen_length", DEFAULT_GEN_LENGTH)


def _print_table(importance: tuple[float, ...], inputs: int, tokens: int, layers: tuple[int, ...],
                 counted: str = "tokens") -> None:
    """I(l) per measured layer (``layers``: their indices in the model), the first and last as the boundary;
    ``counted``: what the tokens the mean ran over are (DiffusionGemma's: its canvases')."""
    from rich.table import Table

    top = max(importance) or 1.0
    last = len(importance) - 1
    table = Table(title=f"layer importance I(l) over {inputs} inputs, {tokens} {counted}", title_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("I(l)", justify="right")
    table.add_column("", no_wrap=True)
    for i, (layer, value) in enumerate(zip(layers, importance, strict=True)):
        bar = "#" * round(24 * value / top)
        label = f"{layer}" + (" (boundary)" if i in (0, last) else "")
        table.add_row(label, f"{value:.4f}", bar)
    print_wide(report_console(), table)
