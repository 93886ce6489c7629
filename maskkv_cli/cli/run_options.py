"""The options that ask, summarize, generate and profile share, declared once and handed over as one value.

``@run_options(*names)`` adds the shared options ``names`` to a command's parameters (after its own, so they
appear in its ``--help``) and calls the command with ``opts``, a ``RunOptions`` holding their values. The command
then builds everything from that one value: the cache request, the session, the generation settings
(``run_settings.RunSettings`` decides the details). Option flags and help texts come from ``cli/options.py``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from maskkv_cli.cli.options import (
    AlgOpt,
    BlockOpt,
    BudgetOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    EditingOpt,
    GenLengthOpt,
    JsonOpt,
    LayerBudgetsOpt,
    ModelOpt,
    PolicyOpt,
    PostStepsOpt,
    QuantizeOpt,
    QuietOpt,
    RatioOpt,
    SeedOpt,
    StepsOpt,
    TemperatureOpt,
    ThresholdOpt,
    TopKOpt,
    TopPOpt,
    YesOpt,
)
from maskkv_cli.defaults import DEFAULT_POLICY

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RunOptions:
    """The shared options of one command line (a command that does not take one gets its default)."""

    model: str | None = None
    policy: str = DEFAULT_POLICY
    layer_budgets: str = "auto"
    budget: int | None = None
    ratio: float | None = None
    gen_length: int | None = None
    steps: int | None = None
    block_length: int | None = None
    temperature: float = 0.0
    threshold: float | None = None
    alg: str = "entropy"
    top_p: float | None = None
    top_k: int | None = None
    editing_threshold: float | None = None
    max_post_steps: int | None = None
    seed: int = 0
    device: str = "auto"
    device_map: str | None = None
    dtype: str = "auto"
    quantize: str | None = None  # as given; None: the user's default (``quantization``)
    yes: bool = False
    as_json: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        """A bad --quantize or --dtype stops the command before anything is read or loaded (light checks: a wrong
        document path still fails first, before torch is imported; the cache and sampler settings are checked by
        ``cache()``, which the commands call before they load the model)."""
        from maskkv_cli.defaults import check_dtype, check_quantize

        if self.quantize is not None:
            check_quantize(self.quantize)
        check_dtype(self.dtype)

    @property
    def quantization(self) -> str:
        """The weights' quantization (none, int8, int4): ``--quantize``, else ``MASKKV_QUANTIZE`` or the config
        file's ``quantize``, else none; an unknown value is a usage error naming where it was set."""
        from maskkv_cli.defaults import resolve_quantize

        return resolve_quantize(self.quantize)

    def settings(self, **more: Any) -> Any:
        """The run's ``RunSettings`` (``more``: settings only some commands take, e.g. ``cfg_scale``)."""
        from maskkv_cli.app.run_settings import RunSettings

        shared = {f.name for f in fields(RunSettings)}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name in shared}
        return RunSettings(**{**values, **more})

    def cache(self) -> Any:
        """The cache request, checked (a bad budget, ratio or mode is a usage error before anything loads)."""
        return self.settings().cache()

    def load_session(self, device: str, folder: Any = None, policies: Sequence[str] = (),
                     generates: dict[str, Any] | None = None, long: str | None = None,
                     long_modes: tuple[tuple[str, ...], str] | None = None, **more: Any) -> Any:
        """Resolve, offer to pull and load the model on ``device`` (already resolved from ``auto``); ``folder``: the
        ``ModelFolder`` the command resolved ``--model`` to already (``cli.model_choice.pull_first``); ``policies``:
        the cache policies the command runs besides ``--policy`` (``profile --policies``), checked against the
        model's family before it loads; ``generates``: the command generates with ``generation(defaults,
        **generates)``, checked before the weights load (``check_generation``); ``long``: the command's ``--long``,
        likewise checked against the family, and against ``long_modes`` (the modes the command takes, and why no
        other) where it takes only some."""
        from maskkv_cli.app.run_settings import check_long_family, check_policy_family
        from maskkv_cli.cli.model_choice import choose_model, load_session

        settings = self.settings(**(generates or {}))  # with the command's own sampler options (generate's --cfg)
        chosen = choose_model(folder or self.model, self.yes, self.quiet, self.as_json)
        settings.check_family(chosen.config.family)  # options its sampler does not take: refused before loading
        from maskkv_cli.sampling.llada2 import llada2_defaults

        llada2 = settings.llada2(llada2_defaults(chosen.defaults.sampler, str(chosen.path / "generation_config.json")))
        # (the options over the checkpoint's own: both checked now)
        for policy in policies:
            check_policy_family(policy, chosen.config.family)
        self.check_quantization(chosen)
        if long is not None:
            modes, why = long_modes or (None, "")
            check_long_family(long, chosen.config.family, modes, why)
        if generates is not None:
            self.check_generation(chosen, **generates)
        session = load_session(chosen, device, self.dtype, self.quiet, self.as_json, self.device_map,
                               self.yes, dream=settings.dream(), quantize=self.quantization, **more)
        session.llada2 = llada2  # the options given over the model's stored defaults
        return session

    def check_quantization(self, folder: Any) -> None:
        """Refuse, before loading, a quantization the run cannot have: with ``--device-map``, or other than the one
        a pre-quantized checkpoint (``folder``) holds; the message names where it was set (``--quantize``, the
        environment or the config file: a default the user set long ago is no flag to "leave out")."""
        from maskkv_cli.defaults import quantize_origin
        from maskkv_cli.errors import UsageError

        mode = self.quantization
        if mode == "none":
            return
        origin = quantize_origin(self.quantize)
        if self.device_map:
            raise UsageError(f"{origin}: quantized weights with --device-map are not supported (each layer is packed "
                             "for the device it is read on); run on one device, or give --quantize none")
        pre = folder.prequantized
        if pre is not None and pre.mode is not None and mode != pre.mode:
            raise UsageError(f"{folder.name} holds {pre.mode} weights already ({pre.detail}) and {origin} asks for "
                             f"{mode}: give --quantize {pre.mode} or none, or load the model's bf16 release")

    def generation(self, defaults: dict[str, int], **more: Any) -> Any:
        """The ``GenerationConfig`` of these options, gaps filled from the model's ``defaults``."""
        return self.settings(**more).generation(defaults)

    def check_generation(self, folder: Any, **more: Any) -> None:
        """Make the ``generation`` of these options over the stored defaults of ``folder`` (a ``ModelFolder``, the
        ones its session reads), so that settings that do not go together (``--gen-length 7 --block-length 4``, a
        negative ``--cfg``) are a usage error before the weights load, not after."""
        from maskkv_cli.app.run_settings import family_defaults

        self.generation(family_defaults(folder.defaults.generation, folder.config.family), **more)

    def with_(self, **changes: Any) -> RunOptions:
        return replace(self, **changes)


# Each shared option: its declaration (``cli/options.py``) and its default.
DECLARED: dict[str, tuple[Any, Any]] = {
    "model": (ModelOpt, None),
    "policy": (PolicyOpt, DEFAULT_POLICY),
    "layer_budgets": (LayerBudgetsOpt, "auto"),
    "budget": (BudgetOpt, None),
    "ratio": (RatioOpt, None),
    "gen_length": (GenLengthOpt, None),
    "steps": (StepsOpt, None),
    "block_length": (BlockOpt, None),
    "temperature": (TemperatureOpt, 0.0),
    "threshold": (ThresholdOpt, None),
    "alg": (AlgOpt, "entropy"),
    "top_p": (TopPOpt, None),
    "top_k": (TopKOpt, None),
    "editing_threshold": (EditingOpt, None),
    "max_post_steps": (PostStepsOpt, None),
    "seed": (SeedOpt, 0),
    "device": (DeviceOpt, "auto"),
    "device_map": (DeviceMapOpt, None),
    "dtype": (DtypeOpt, "auto"),
    "quantize": (QuantizeOpt, None),
    "yes": (YesOpt, False),
    "as_json": (JsonOpt, False),
    "quiet": (QuietOpt, False),
}
MODEL = ("model", "device", "device_map", "dtype", "quantize", "yes")
CACHE = ("policy", "layer_budgets", "budget", "ratio")
SAMPLER = ("gen_length", "steps", "block_length", "temperature", "threshold", "alg", "top_p", "top_k",
           "editing_threshold", "max_post_steps", "seed")
OUTPUT = ("as_json", "quiet")


def run_options(*names: str, worded: dict[str, Any] | None = None) -> Callable[[F], F]:
    """Give the decorated command the shared options ``names`` (see the module doc); it takes ``opts``. ``worded``:
    an option's declaration with the command's own help (``eval``'s ``--model``, which downloads nothing)."""
    unknown = [n for n in names if n not in DECLARED]
    if unknown:
        raise ValueError(f"not a shared option: {', '.join(unknown)}")

    def decorate(fn: F) -> F:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "opts"]
        shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=DECLARED[n][1],
                                    annotation=(worded or {}).get(n, DECLARED[n][0])) for n in names]

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            opts = RunOptions(**{n: kwargs.pop(n) for n in names if n in kwargs})
            return fn(*args, opts=opts, **kwargs)

        command.__signature__ = inspect.Signature(own + shared)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in own + shared}
        return command  # type: ignore[return-value]

    return decorate
