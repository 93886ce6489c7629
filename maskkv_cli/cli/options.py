"""Command-line options declared once and shared by every command (``Annotated`` aliases).

An option that several commands take with a help text of their own (``--seed``, ``--policies``, ``--out``,
``--questions``, ``--tasks``) is declared once by a function whose parameter is that text; each command's alias
below calls it.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.bench.quality_plan import DEFAULT_LENGTHS, FALLBACK_GENERATION
from maskkv_cli.tasks.synthetic import KINDS


def declare(flag: str) -> Callable[..., Any]:
    """The one declaration of an option ``flag`` several commands take: a function ``(help, *short, **settings)`` that
    gives its ``typer.Option``, so that each command describes the flag in its own words (``short``: one-letter
    aliases such as ``-n``; ``settings``: Typer's, e.g. ``show_default``)."""

    def option(help: str | None = None, *short: str, **settings: Any) -> Any:
        return typer.Option(flag, *short, help=help, **settings)

    option.__doc__ = f"``{flag}``: see ``declare``."
    return option


def options_command(options_type: type[Any], declarations: Mapping[str, Any], run: Callable[..., None],
                    extra: Sequence[inspect.Parameter] = ()) -> Callable[..., None]:
    """A Typer command whose options are the fields of the dataclass ``options_type``, in field order, each declared
    by ``declarations[field]`` with the field's default, and whose body gets them as one object:
    ``run(options_type(**fields), **extra)``. ``extra``: further parameters (``Annotated`` with their declaration)
    that are not settings of the object, such as how the command prints. The command's help is ``run``'s
    docstring."""
    hints = typing.get_type_hints(options_type)
    fields = [f.name for f in dataclasses.fields(options_type)]
    parameters = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                    annotation=Annotated[hints[f.name], declarations[f.name]])
                  for f in dataclasses.fields(options_type)]
    parameters += list(extra)

    def command(**given: Any) -> None:
        run(options_type(**{name: given.pop(name) for name in fields}), **given)

    command.__name__, command.__qualname__, command.__doc__ = run.__name__, run.__qualname__, run.__doc__
    command.__module__ = run.__module__
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command


model_option = declare("--model")
budget_option = declare("--budget")
budgets_option = declare("--budgets")
ratio_option = declare("--ratio")
gen_length_option = declare("--gen-length")
steps_option = declare("--steps")
block_length_option = declare("--block-length")
device_option = declare("--device")
json_option = declare("--json")
seed_option = declare("--seed")
policies_option = declare("--policies")
out_option = declare("--out")
questions_option = declare("--questions")
tasks_option = declare("--tasks")
samples_option = declare("--samples")
config_option = declare("--config")
threads_option = declare("--threads")
length_option = declare("--length")
batch_size_option = declare("--batch-size")
repeats_option = declare("--repeats")
quantize_option = declare("--quantize")
long_option = declare("--long")


ModelOpt = Annotated[str | None, model_option(
    "Checkpoint folder or a Hugging Face id (ORG/NAME) in the local HF cache; an id not there "
    "is downloaded only with `maskkv pull`, --yes or your consent. Default: MASKKV_MODEL, the config file, else the "
    "embedded tiny model.", "-m", show_default=False)]
EvalModelOpt = Annotated[str | None, model_option(
    "Checkpoint folder or a Hugging Face id (ORG/NAME) in the local HF cache (each rank loads it: download an id "
    "first with `maskkv pull`). Default: MASKKV_MODEL, the config file, else the embedded tiny model.", "-m",
    show_default=False)]
PolicyOpt = Annotated[str, typer.Option("--policy", "-p", help="KV-cache policy (see `maskkv policies`).")]
BudgetOpt = Annotated[int | None, budget_option(
    "Average prompt K/V pairs kept per head per layer [default: 256].", "-b", show_default=False)]
RatioOpt = Annotated[float | None, ratio_option(
    "Budget as a share of the prompt length, in (0, 1]; instead of --budget.", show_default=False)]
GenLengthOpt = Annotated[int | None, gen_length_option(
    "Response tokens to generate [default: the model's, else 128].", "-n", show_default=False)]
StepsOpt = Annotated[int | None, steps_option(
    "Denoising steps in all, split evenly over blocks [default: the model's; one per token where the answer's "
    "length is given].",
    show_default=False)]
BlockOpt = Annotated[int | None, block_length_option(
    "LLaDA and LLaDA2: tokens per semi-autoregressive block [default: the model's, else 32, or one block where 32 "
    "does not divide the length].", show_default=False)]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy (argmax).")]
ThresholdOpt = Annotated[float | None, typer.Option(
    "--threshold", help="LLaDA and LLaDA2: parallel decoding, commit every masked token of the block with "
    "confidence above this [LLaDA2: the model's, else 0.95].", show_default=False)]
CfgOpt = Annotated[float, typer.Option("--cfg", help="LLaDA only: classifier-free guidance scale (0 = off).")]
RemaskOpt = Annotated[str, typer.Option("--remasking", help="LLaDA only: low_confidence or random.")]
DeviceOpt = Annotated[str, device_option("cpu, cuda, cuda:1, ... (auto: cuda if available).")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", help="auto (bf16 on a GPU, and on the CPU with int4 weights; else fp32), bf16, fp16, fp32.")]
SeedOpt = Annotated[int, seed_option("Random seed (sampling noise, random policy).")]
JsonOpt = Annotated[bool, json_option("Print machine-readable JSON only.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="No progress display and no notes.")]
PasswordOpt = Annotated[str | None, typer.Option("--password", help="Password of an encrypted PDF.",
                                                 show_default=False)]
LongOpt = Annotated[str, long_option(
    "Documents longer than the window: parts (read all of it in overlapping parts, each asked; the "
    "answer from the most confident), truncate (keep start and end, cut the middle: faster, the answer says what "
    "was cut) or rope-scale (NTK-style RoPE base scaling, one prompt beyond the window).")]
ProfileLongOpt = Annotated[str, long_option(
    "Documents longer than the window (profile measures one prompt): truncate (keep start and end, cut the "
    "middle) or rope-scale (NTK-style RoPE base scaling, one prompt beyond the window).")]
LayerBudgetsOpt = Annotated[str, typer.Option(
    "--layer-budgets", help="MaskKV layer budgets: auto (the model's calibration profile if present, else uniform), "
    "online (from this input; holds the full cache during the prefill), uniform.")]
DeviceMapOpt = Annotated[str | None, typer.Option(
    "--device-map", help="Spread the layers over devices: auto (every visible GPU) or a list like cuda:0,cuda:1; "
    "each layer's compressed cache stays on its device.", show_default=False)]
AlgOpt = Annotated[str, typer.Option(
    "--alg", help="Dream only: confidence rule (origin, maskgit_plus, topk_margin, entropy).")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Dream and LLaDA2: nucleus sampling.",
                                               show_default=False)]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Dream and LLaDA2: top-k sampling.", show_default=False)]
EditingOpt = Annotated[float | None, typer.Option(
    "--editing-threshold", help="LLaDA2.1: token editing, re-write a written token whose new choice is more probable "
    "than this (LLaDA2.1's quality setting: 0.5; 1 runs its loop without edits) [default: the model's, else off: "
    "LLaDA2.0's sampler].", show_default=False)]
PostStepsOpt = Annotated[int | None, typer.Option(
    "--max-post-steps", help="LLaDA2.1: steps a block may keep editing after its last mask [default: the model's, "
    "else 16].", show_default=False)]

QuantizeOpt = Annotated[str | None, quantize_option(
    "Weight-only quantization of the linear layers and experts as they load: int8 or int4 (torchao: pip install -e "
    "'.[quant]'; int4 on CUDA: bf16 only), or none [default: MASKKV_QUANTIZE or `quantize = ...` in the config "
    "file, else none].", show_default=False)]
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
ConfigOpt = Annotated[str | None, config_option(
    "Named model shape with random weights (llada-8b, llada-small, tiny, ...; DiffusionGemma: diffusiongemma-tiny, "
    "diffusiongemma-small, diffusiongemma-26b-a4b) [default: llada-8b on a GPU, llada-small on the CPU].",
    show_default=False)]
BenchModelOpt = Annotated[str | None, model_option(
    "A checkpoint folder instead of random weights.", "-m", show_default=False)]
BenchGenOpt = Annotated[int, gen_length_option("Response tokens to generate.", "-n")]
BenchStepsOpt = Annotated[int | None, steps_option(
    "Denoising steps in all, split evenly over blocks (DiffusionGemma: decoder passes per canvas) [default: 128; "
    "DiffusionGemma: 48].", show_default=False)]
BenchBlockOpt = Annotated[int, block_length_option("Tokens per semi-autoregressive block.")]
ThreadsOpt = Annotated[int, threads_option("torch threads in each case's process.")]
BenchQuantizeOpt = Annotated[str, quantize_option(
    "Weight quantization of the model, each a case: comma-separated none, int8, int4 (torchao; the config file's "
    "default does not apply to benchmarks).")]
OutOpt = Annotated[Path | None, out_option(
    "Results folder [default: runs/bench-KIND-TIMESTAMP, or the latest folder with identical settings, whose "
    "finished rows are reused].", show_default=False)]
FreshOpt = Annotated[bool, typer.Option("--fresh", help="Measure every case again (do not reuse finished rows).")]
SpeedPoliciesOpt = Annotated[str, policies_option("Comma-separated policies to compare.")]
MemoryPoliciesOpt = Annotated[str, policies_option("Cached policies to compare (full is the reference).")]

# bench quality and bench tasks
TasksOpt = Annotated[str, tasks_option(
    f"Comma-separated task kinds ({', '.join(KINDS)}), or a .jsonl file (LongBench format or `maskkv` export; "
    "scored with the metric of each record's dataset, exact match if unknown).")]
LengthsOpt = Annotated[str | None, typer.Option(
    "--lengths", help=f"Context lengths in tokens of the generated tasks, e.g. 256,1k [default: "
    f"{','.join(map(str, DEFAULT_LENGTHS))}].", show_default=False)]
QualitySamplesOpt = Annotated[int, samples_option(
    "Tasks per (task, length); for a file, the first N records of each dataset.", "-n")]
QualitySeedOpt = Annotated[int, seed_option("Seed of the generated tasks and of the random policy.")]
QualityPoliciesOpt = Annotated[str, policies_option("Comma-separated policies (see `maskkv policies`).")]
TaskKindsOpt = Annotated[str, tasks_option(f"Comma-separated task kinds ({', '.join(KINDS)}).")]
TasksSeedOpt = Annotated[int, seed_option("Seed of the tasks (the same seed, lengths and model give bench quality's "
                                          "tasks).")]
QualityBudgetsOpt = Annotated[str, budgets_option(
    "Budgets (K/V pairs per head per layer) of the evicting policies; full and none run once.")]
QualityGenOpt = Annotated[int | None, gen_length_option(
    f"Response tokens [default: the model's, else {FALLBACK_GENERATION['gen_length']}; "
    "LongBench tasks: their own (32-512, one token per step)].", show_default=False)]
PromptsOpt = Annotated[Path | None, typer.Option(
    "--prompts", help="With a LongBench --tasks file: a JSON object of dataset -> template with {context} and "
    "{input} (e.g. LongBench's dataset2prompt.json) instead of the built-in wording.", show_default=False)]
QualityStepsOpt = Annotated[int | None, steps_option(
    f"Denoising steps [default: the model's, else {FALLBACK_GENERATION['steps']}; LongBench tasks "
    "answered at their own length: one step per token].", show_default=False)]
QualityBlockOpt = Annotated[int | None, block_length_option(
    f"Tokens per block [default: the model's, else {FALLBACK_GENERATION['block_length']}].", show_default=False)]
HaystackOpt = Annotated[Path | None, typer.Option(
    "--haystack", help="Hide the needles in this document (PDF, text, Markdown; split into paragraphs) or in a "
    "named source of text every Python has: corpus (the default), pydoc-topics, stdlib-train, stdlib-heldout (the "
    "embedded model never saw it), pdf-train, pdf-heldout (the same typeset as a PDF), docs, license.",
    show_default=False)]

# ask
QuestionsFileOpt = Annotated[Path | None, questions_option(
    "A file with one question per line (blank lines and lines starting with # skipped).", show_default=False)]
BatchJobsOpt = Annotated[str, batch_size_option(
    "Jobs of equal settings a worker denoises together in one forward (consecutive jobs, one document after "
    "another): a number, or auto (up to 16 jobs sent at once, as many prompts at a time as fit free memory by the "
    "memory model; 1 where a batch would share too little of their work: long prompts, short answers). Each answer "
    "is the one it gets alone.")]
CellBatchOpt = Annotated[str, batch_size_option(
    "A row's tasks denoised together in one forward: a number, or auto (as many as fit free memory by the memory "
    "model; 1 where a batch would share too little of their work). Scores do not depend on it; s/sample is then "
    "the row's time shared equally.")]
ServeBatchOpt = Annotated[str, batch_size_option(
    "Requests whose generations run together in one forward (each answer the one it gets alone): a number, or "
    "auto (as many window-long prompts as fit free memory by the memory model, at most 1 + --queue); 1: one "
    "request at a time. DiffusionGemma runs each request's passes alone.")]
AskBatchOpt = Annotated[str, batch_size_option(
    "Questions (two or more, with the parts of a long document) denoised together in one forward: a number, or "
    "auto (the most that "
    "fit free memory by the memory model; 1 where a batch would share too little of their work: long prompts, "
    "short answers). Each answer is the one it gets alone.")]

# batch
BatchOutOpt = Annotated[Path | None, out_option(
    "Results folder (answers.jsonl, config.json, summary.md); a rerun into it skips finished jobs.", "-o",
    show_default=False)]
BatchQuestionsOpt = Annotated[Path | None, questions_option(
    "With --docs: a file with one question per line (blank lines and lines starting with # skipped).",
    show_default=False)]

# eval
HarnessTasksOpt = Annotated[str, tasks_option(
    "Comma-separated harness task or group names, e.g. longbench_hotpotqa,gsm8k, or names from --include-path.")]
EvalBatchOpt = Annotated[str, batch_size_option(
    "Generation requests of one answer length denoised together in one forward: a number, or auto (the most that "
    "fit free memory by the memory model; 1 where a batch would share too little of their work). Each answer is "
    "the one it gets alone.")]

# calibrate
CalibrationSamplesOpt = Annotated[int, samples_option("Calibration inputs (document windows) at most.")]
MaxTokensOpt = Annotated[int, typer.Option(
    "--max-tokens", help="Document tokens per input (the chat template and the masks come on top).")]

# profile
ProfilePoliciesOpt = Annotated[str, policies_option(
    "Policies to compare, separated by commas (see `maskkv policies`).", "-p")]
ProfileBudgetsOpt = Annotated[str | None, budgets_option(
    "Budgets (average prompt K/V pairs kept per head per layer), separated by commas "
    "[default: 256].", "-b", show_default=False)]
RatiosOpt = Annotated[str | None, ratio_option(
    "Budgets as shares of the prompt length in (0, 1], separated by commas; instead of --budgets.", show_default=False)]
HeatmapOpt = Annotated[str | None, typer.Option(
    "--heatmap", help="The run to draw, as POLICY@BUDGET [default: the first run that evicts].",
    show_default=False)]
PlotOpt = Annotated[Path | None, typer.Option(
    "--plot", help="Also write the pictures to this PNG file (needs matplotlib: pip install 'maskkv[plot]').",
    show_default=False)]
HtmlOpt = Annotated[Path | None, typer.Option(
    "--html", help="Also write a self-contained HTML report to this file.", show_default=False)]
WarmupOpt = Annotated[bool, typer.Option(
    "--warmup/--no-warmup", help="Run the first policy once on this prompt before measuring (its time is shown "
    "apart: one-time costs).")]
