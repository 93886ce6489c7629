"""Command-line options declared once and shared by every command (``Annotated`` aliases)."""

from __future__ import annotations

from typing import Annotated

import typer

ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help="Checkpoint folder or a Hugging Face id (ORG/NAME) in the local HF cache; an id not there "
    "is downloaded only with `maskkv pull`, --yes or your consent. Default: MASKKV_MODEL, the config file, else the "
    "embedded tiny model.", show_default=False)]
PolicyOpt = Annotated[str, typer.Option("--policy", "-p", help="KV-cache policy (see `maskkv policies`).")]
BudgetOpt = Annotated[int | None, typer.Option(
    "--budget", "-b", help="Average prompt K/V pairs kept per head per layer [default: 256].", show_default=False)]
RatioOpt = Annotated[float | None, typer.Option(
    "--ratio", help="Budget as a share of the prompt length, in (0, 1]; instead of --budget.", show_default=False)]
GenLengthOpt = Annotated[int | None, typer.Option(
    "--gen-length", "-n", help="Response tokens to generate [default: the model's, else 128].", show_default=False)]
StepsOpt = Annotated[int | None, typer.Option(
    "--steps", help="Denoising steps in all, split evenly over blocks [default: gen length].", show_default=False)]
BlockOpt = Annotated[int | None, typer.Option(
    "--block-length", help="Tokens per semi-autoregressive block [default: 32].", show_default=False)]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy (argmax).")]
ThresholdOpt = Annotated[float | None, typer.Option(
    "--threshold", help="Parallel decoding: commit every masked token of the block with confidence above this.",
    show_default=False)]
CfgOpt = Annotated[float, typer.Option("--cfg", help="Classifier-free guidance scale (0 = off).")]
RemaskOpt = Annotated[str, typer.Option("--remasking", help="low_confidence or random.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:1, ... (auto: cuda if available).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed (sampling noise, random policy).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="No progress display and no notes.")]
PasswordOpt = Annotated[str | None, typer.Option("--password", help="Password of an encrypted PDF.",
                                                 show_default=False)]
LongOpt = Annotated[str, typer.Option(
    "--long", help="Documents longer than the window: truncate (keep start and end, cut the middle) or rope-scale "
    "(NTK-style RoPE base scaling, keeps everything).")]
LayerBudgetsOpt = Annotated[str, typer.Option(
    "--layer-budgets", help="MaskKV layer budgets: auto (the model's calibration profile if present, else uniform), "
    "online (from this input; holds the full cache during the prefill), uniform.")]
DeviceMapOpt = Annotated[str | None, typer.Option(
    "--device-map", help="Spread the layers over devices: auto (every visible GPU) or a list like cuda:0,cuda:1; "
    "each layer's compressed cache stays on its device.", show_default=False)]
AlgOpt = Annotated[str, typer.Option(
    "--alg", help="Dream only: confidence rule (origin, maskgit_plus, topk_margin, entropy).")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Dream only: nucleus sampling.", show_default=False)]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Dream only: top-k sampling.", show_default=False)]
