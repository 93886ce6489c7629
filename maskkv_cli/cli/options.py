"""Command-line options declared once and shared by every command (``Annotated`` aliases)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from maskkv_cli.bench.quality_plan import DEFAULT_LENGTHS, FALLBACK_GENERATION
from maskkv_cli.tasks.synthetic import KINDS

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

YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Download a --model ORG/NAME that is not on this machine "
                                      "without asking (`maskkv pull`).")]


# batch and bench quality: where the answers run
DevicesOpt = Annotated[str | None, typer.Option(
    "--devices", help="One worker process per device, e.g. cuda:0,cuda:1 (each loads the model once).",
    show_default=False)]
WorkersOpt = Annotated[int | None, typer.Option(
    "--workers", help="N worker processes on the CPU (torch threads split between them); with --ray: N actors.",
    show_default=False)]
RayOpt = Annotated[str | None, typer.Option(
    "--ray", help="Run on a Ray cluster: auto (this machine's cluster, else a local one) or its address "
    "(host:6379). One actor per GPU (CPU actors when it has none). Needs pip install 'maskkv[ray]'.",
    show_default=False)]

# bench speed and bench memory
ConfigOpt = Annotated[str | None, typer.Option(
    "--config", help="Named model shape with random weights (llada-8b, llada-small, tiny) [default: llada-8b on a "
    "GPU, llada-small on the CPU].", show_default=False)]
BenchModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help="A checkpoint folder instead of random weights.", show_default=False)]
BenchGenOpt = Annotated[int, typer.Option("--gen-length", "-n", help="Response tokens to generate.")]
BenchStepsOpt = Annotated[int, typer.Option("--steps", help="Denoising steps in all (split evenly over blocks).")]
BenchBlockOpt = Annotated[int, typer.Option("--block-length", help="Tokens per semi-autoregressive block.")]
ThreadsOpt = Annotated[int, typer.Option("--threads", help="torch threads in each case's process.")]
OutOpt = Annotated[Path | None, typer.Option(
    "--out", help="Results folder [default: runs/bench-<kind>-<timestamp>, or the latest folder with identical "
    "settings, whose finished rows are reused].", show_default=False)]
FreshOpt = Annotated[bool, typer.Option("--fresh", help="Measure every case again (do not reuse finished rows).")]

# bench quality and bench tasks
TasksOpt = Annotated[str, typer.Option(
    "--tasks", help=f"Comma-separated task kinds ({', '.join(KINDS)}), or a .jsonl file "
    "(LongBench format or `maskkv` export; scored with the metric of each record's dataset, exact match if "
    "unknown).")]
LengthsOpt = Annotated[str | None, typer.Option(
    "--lengths", help=f"Context lengths in tokens of the generated tasks, e.g. 256,1k [default: "
    f"{','.join(map(str, DEFAULT_LENGTHS))}].", show_default=False)]
QualitySamplesOpt = Annotated[int, typer.Option(
    "--samples", "-n", help="Tasks per (task, length); for a file, the first N records of each dataset.")]
QualitySeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the generated tasks and of the random policy.")]
QualityPoliciesOpt = Annotated[str, typer.Option(
    "--policies", help="Comma-separated policies (see `maskkv policies`).")]
QualityBudgetsOpt = Annotated[str, typer.Option(
    "--budgets", help="Budgets (K/V pairs per head per layer) of the evicting policies; full and none run once.")]
QualityGenOpt = Annotated[int | None, typer.Option(
    "--gen-length", help=f"Response tokens [default: the model's, else {FALLBACK_GENERATION['gen_length']}; "
    "LongBench tasks: their own (32-512, one token per step)].", show_default=False)]
PromptsOpt = Annotated[Path | None, typer.Option(
    "--prompts", help="With a LongBench --tasks file: a JSON object of dataset -> template with {context} and "
    "{input} (e.g. LongBench's dataset2prompt.json) instead of the built-in wording.", show_default=False)]
QualityStepsOpt = Annotated[int | None, typer.Option(
    "--steps", help=f"Denoising steps [default: the model's, else {FALLBACK_GENERATION['steps']}; LongBench tasks "
    "answered at their own length: one step per token].", show_default=False)]
QualityBlockOpt = Annotated[int | None, typer.Option(
    "--block-length", help=f"Tokens per block [default: the model's, else {FALLBACK_GENERATION['block_length']}].",
    show_default=False)]
HaystackOpt = Annotated[Path | None, typer.Option(
    "--haystack", help="Hide the needles in this document (PDF, text, Markdown; split into paragraphs) or in a "
    "named source of text every Python has: corpus (the default), pydoc-topics, stdlib-train, stdlib-heldout (the "
    "embedded model never saw it), pdf-train, pdf-heldout (the same typeset as a PDF), docs, license.",
    show_default=False)]

# calibrate
CalibrationSamplesOpt = Annotated[int, typer.Option("--samples", help="Calibration inputs (document windows) at most.")]
MaxTokensOpt = Annotated[int, typer.Option(
    "--max-tokens", help="Document tokens per input (the chat template and the masks come on top).")]

# profile
ProfilePoliciesOpt = Annotated[str, typer.Option(
    "--policies", "-p", help="Policies to compare, separated by commas (see `maskkv policies`).")]
ProfileBudgetsOpt = Annotated[str | None, typer.Option(
    "--budgets", "-b", help="Budgets (average prompt K/V pairs kept per head per layer), separated by commas "
    "[default: 256].", show_default=False)]
RatiosOpt = Annotated[str | None, typer.Option(
    "--ratio", help="Budgets as shares of the prompt length in (0, 1], separated by commas; instead of --budgets.",
    show_default=False)]
HeatmapOpt = Annotated[str | None, typer.Option(
    "--heatmap", help="The run to draw, as POLICY@BUDGET [default: the first run that evicts].",
    show_default=False)]
PlotOpt = Annotated[Path | None, typer.Option(
    "--plot", help="Also write the pictures to this PNG file (needs matplotlib: pip install 'maskkv[plot]').",
    show_default=False)]
HtmlOpt = Annotated[Path | None, typer.Option(
    "--html", help="Also write a self-contained HTML report to this file.", show_default=False)]
WarmupOpt = Annotated[bool, typer.Option(
    "--warmup/--no-warmup", help="Run the first policy once on the question alone before measuring.")]
