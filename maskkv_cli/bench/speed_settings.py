"""What ``maskkv bench speed`` measures: one case (``SpeedCase``, every setting that decides one row), the sweep's
settings (``SpeedSettings``: the cases it runs, checked once before anything runs), and when a case's warm-up also
runs its own prefill (``warms_own_length``, for LLaDA-style and DiffusionGemma cases alike)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from maskkv_cli.bench.results import JsonCase, settings_key
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.errors import UsageError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SpeedCase(JsonCase):
    """Everything that decides one row of the sweep."""

    policy: str
    budget: int | None
    prompt_len: int
    gen_length: int = 128
    steps: int = 128
    block_length: int = 32
    config: str | None = "llada-small"
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    none_steps: int = 3
    seed: int = 0
    threads: int = 1
    limit: bool = True
    warmup: bool = True
    step_mode: str = "eager"  # later steps: eager, compile, cuda-graph or compile+cuda-graph (step_runner.py)
    batch_size: int = 1  # sequences generated together (sample_many); 1: the single-sequence path
    quantize: str = "none"  # the weights' quantization: none, int8, int4 (models/quantize.py)
    model_id: str | None = None  # ``model``'s files hashed (models.fingerprint): another checkpoint, another key

    def key(self) -> str:
        """The hash of the settings; batch size 1, unquantized weights and a missing model id are left out, so that
        a case keeps the key it had before batches and quantization."""
        settings = asdict(self)
        if self.batch_size == 1:
            del settings["batch_size"]
        if self.quantize == "none":
            del settings["quantize"]
        if self.model_id is None:
            del settings["model_id"]
        return settings_key(settings)

    @property
    def method(self) -> str:
        """The policy and budget, with the step mode when not eager (the weights' quantization is a column of its
        own, ``quantize``)."""
        name = self.policy if self.budget is None else f"{self.policy}@{self.budget}"
        return name if self.step_mode == "eager" else f"{name} {self.step_mode}"


def is_gemma_shape(config: str | None) -> bool:
    """Whether ``config`` names a DiffusionGemma shape (``models/diffusion_gemma_config.py``)."""
    from maskkv_cli.models.diffusion_gemma_config import NAMED_CONFIGS

    return config in NAMED_CONFIGS


def check_shape(config: str | None) -> str | None:
    """``config`` when it names a shape ``bench speed`` builds with random weights (a family's named config or a
    DiffusionGemma shape), or None; an unknown name is a usage error, before any case runs."""
    from maskkv_cli.models.config import NAMED_CONFIGS
    from maskkv_cli.models.diffusion_gemma_config import NAMED_CONFIGS as GEMMA_CONFIGS

    if config is not None and config not in NAMED_CONFIGS and config not in GEMMA_CONFIGS:
        raise UsageError(f"--config: unknown model shape {config!r}; choose one of: "
                         f"{', '.join([*NAMED_CONFIGS, *GEMMA_CONFIGS])}")
    return config


def runs_gemma(config: str | None, model: str | None) -> bool:
    """Whether a sweep runs DiffusionGemma: the checkpoint ``model``'s family (its config.json), else the shape."""
    if model:
        from maskkv_cli.models.checkpoint import ModelFolder

        return ModelFolder.of(model).config.family == "diffusion_gemma"
    return is_gemma_shape(config)


GEMMA_STEPS = 48  # a DiffusionGemma case's decoder passes per canvas unless --steps says (the released schedule's)


def check_gemma_fits(name: str, device: str, dtype: str) -> None:
    """Refuse, in one line, a DiffusionGemma shape whose random weights do not fit the free memory of ``device``
    (none is allocated: counted on the meta device)."""
    import torch

    from maskkv_cli.engine.batch_memory import free_bytes
    from maskkv_cli.models.diffusion_gemma import parameter_count
    from maskkv_cli.models.diffusion_gemma_config import named_config
    from maskkv_cli.models.loading import parse_dtype
    from maskkv_cli.runtime.sizes import human_size

    dev = torch.device(device)
    dt = parse_dtype(dtype, dev)
    need = parameter_count(named_config(name)) * (torch.finfo(dt).bits // 8)
    free = free_bytes(dev)
    if free and need > free:
        raise UsageError(f"{name}: its random {str(dt).removeprefix('torch.')} weights take "
                         f"{human_size(need, binary=True)} and the {dev.type} has {human_size(free, binary=True)} "
                         "free; run it where they fit (diffusiongemma-26b-a4b: --device cuda on a GPU of 80 GB, "
                         "bf16) or take diffusiongemma-small")


def gen_config(case: SpeedCase, gen_length: int | None = None, steps: int | None = None) -> Any:
    from maskkv_cli.sampling import GenerationConfig

    return GenerationConfig(gen_length=gen_length or case.gen_length, steps=steps or case.steps,
                            block_length=min(case.block_length, gen_length or case.gen_length), seed=case.seed)


@dataclass(frozen=True)
class SpeedSettings:
    prompt_lengths: tuple[int, ...] = (1024, 2048, 4096)
    policies: tuple[str, ...] = ("none", "full", "maskkv")
    budgets: tuple[int, ...] = (64, 256, 1024)
    gen_length: int = 128
    steps: int = 128
    block_length: int = 32
    config: str | None = "llada-small"
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    none_steps: int = 3
    seed: int = 0
    threads: int = 1
    limit: bool = True
    warmup: bool = True
    step_modes: tuple[str, ...] = ("eager",)  # each cache policy runs once per mode; ``none`` always eager
    batch_sizes: tuple[int, ...] = (1,)  # each method runs once per batch size
    repeats: int = 1  # runs of every case, round by round; a row is its case's median run
    quantize: tuple[str, ...] = ("none",)  # each method runs once per weight quantization

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON; batch sizes (1,), one repeat and unquantized weights only are left out, so a run
        finds its folder from before those settings."""
        d = asdict(self)
        for k in ("prompt_lengths", "policies", "budgets", "step_modes", "batch_sizes", "quantize"):
            d[k] = list(d[k])
        if self.batch_sizes == (1,):
            del d["batch_sizes"]
        if self.repeats == 1:
            del d["repeats"]
        if self.quantize == ("none",):
            del d["quantize"]
        return d

    def cases(self) -> list[SpeedCase]:
        """For each prompt length (ascending): none, full, then each evicting policy at each budget, each at every
        batch size (ascending), each with every weight quantization in the order given (so that with --repeats
        the quantizations of one method alternate, run after run)."""
        from maskkv_cli.models.fingerprint import model_fingerprint
        from maskkv_cli.policies.base import get_policy

        common = dict(gen_length=self.gen_length, steps=self.steps, block_length=self.block_length,
                      config=None if self.model else self.config, model=self.model, device=self.device,
                      dtype=self.dtype, none_steps=self.none_steps, seed=self.seed, threads=self.threads,
                      limit=self.limit, warmup=self.warmup,
                      model_id=model_fingerprint(self.model) if self.model else None)
        out: list[SpeedCase] = []
        for m in sorted(set(self.prompt_lengths)):
            for name in self.policies:
                policy = get_policy(name)
                modes = self.step_modes if policy.uses_cache else ("eager",)
                budgets: Sequence[int | None] = self.budgets if policy.evicts else (None,)
                out.extend(SpeedCase(name, b, m, step_mode=mode, batch_size=n, quantize=q,  # type: ignore[arg-type]
                                     **common)
                           for mode in modes for b in budgets for n in sorted(set(self.batch_sizes))
                           for q in self.quantize)
        return out

    def check(self) -> None:
        from maskkv_cli.policies.base import get_policy

        if not self.prompt_lengths or min(self.prompt_lengths) <= 0:
            raise UsageError("--prompt-lengths must be positive numbers (e.g. 1k,2k,4k)")
        if not self.policies:
            raise UsageError("--policies is empty")
        for name in self.policies:
            if get_policy(name).evicts and (not self.budgets or min(self.budgets) <= 0):
                raise UsageError(f"policy {name} needs positive --budgets")
        if self.none_steps < 1:
            raise UsageError("--none-steps must be at least 1")
        if self.threads < 1:
            raise UsageError("--threads must be at least 1")
        if not self.step_modes:
            raise UsageError("--step-modes is empty")
        for mode in self.step_modes:
            options = StepOptions.from_label(mode)
            if options.cuda_graph and not self.device.startswith("cuda"):
                raise UsageError(f"step mode {mode} needs --device cuda")
        if self.repeats < 1:
            raise UsageError("--repeats must be at least 1")
        from maskkv_cli.defaults import check_quantize

        if not self.quantize or len(set(self.quantize)) < len(self.quantize):
            raise UsageError("--quantize must name distinct modes, e.g. none,int8,int4")
        for mode in self.quantize:
            check_quantize(mode)
        if runs_gemma(self.config, self.model):
            self._check_gemma()
            return
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise UsageError("--batch-sizes must be positive whole numbers (e.g. 1,8)")
        if max(self.batch_sizes) > 1:
            if any(not StepOptions.from_label(mode).eager for mode in self.step_modes):
                raise UsageError("--batch-sizes above 1 run eager steps only (compiled or captured steps run one "
                                 "sequence at a time); use --step-modes eager")
        gen_config(self.cases()[0])  # validates gen length, steps and block length

    def _check_gemma(self) -> None:
        """A DiffusionGemma shape: one generation at a time, eager passes; ``steps`` per canvas, the gen length
        rounded up to whole canvases (block length unused)."""
        what = self.model or self.config
        if self.batch_sizes != (1,):
            raise UsageError(f"{what}: DiffusionGemma runs one generation at a time; use --batch-sizes 1")
        if self.step_modes != ("eager",):
            raise UsageError(f"{what}: --step-modes other than eager are not available for DiffusionGemma")
        if self.gen_length < 1 or self.steps < 1:
            raise UsageError("--gen-length and --steps must be positive")
        from maskkv_cli.app.run_settings import check_policy_family

        for name in self.policies:
            check_policy_family(name, "diffusion_gemma")
        if not self.model:
            check_gemma_fits(self.config or "", self.device, self.dtype)


OWN_LENGTH_WARMUP_CPU = 4096  # prompt tokens up to which a case off CUDA also warms up at its own length


def warms_own_length(device: torch.device, prompt_len: int) -> bool:
    """Whether the warm-up also runs one prefill at the case's own prompt length, gen length, budget and batch
    size, so that the timed prefill is not the process's first at that size.

    On CUDA always: the first long prefill would otherwise pay, inside the timed ``prefill_s``, the caching
    allocator's growth to the case's size (cudaMalloc of the cache and activations, about 17 GB for ``full`` at
    32k on an 8B shape) and any per-shape kernel or plan choice. Elsewhere up to ``OWN_LENGTH_WARMUP_CPU`` prompt
    tokens: on the CPU the first prefill at a new size also pays a one-time cost (the kernel's first mapping of
    the larger heap and buffers: on llada-small the first 1k prefill after the 256-token warm-up took 0.1-0.7 s
    more than the next ones, with about twice the system time, docs/performance.md), which is a fifth of a 1k
    prefill and a few percent of a 4k one; a longer prompt's extra prefill would take minutes for a cost of about
    a percent."""
    return device.type == "cuda" or prompt_len <= OWN_LENGTH_WARMUP_CPU
