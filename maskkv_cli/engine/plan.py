"""The cache plan: every decision about one generation's prompt cache, made once and passed down as one value.

``CacheConfig`` is what a user asks for (policy, budget or ratio, policy options, where the layer importance
comes from). ``plan_cache`` turns it, for one prompt of one model, into a ``CachePlan``: the policy object, the
budget in entries per head (the ratio resolved, the default filled in), the layer-importance source (a
calibration profile, this input measured online, or uniform layer budgets), whether the run evicts at all
(against the prompt segment that is actually cached), the per-layer budgets, the step options and the one-line
note for the user. The samplers, ``Denoising`` and ``CachedForward`` receive only the plan, and the run's result
carries it, so a report reads what the run used instead of deciding it again.

``CachePlan.build`` is the low-level half, from a policy object and a budget (what ``sampling.generate``, the
documented Python entry, calls).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from maskkv_cli.defaults import DEFAULT_BUDGET, DEFAULT_POLICY, LAYER_BUDGET_CHOICES, configured_model
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.errors import UsageError
from maskkv_cli.kv.budgets import check_budget, check_ratio, resolve_budget
from maskkv_cli.kv.prefix import PrefixStore
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.policies.base import Policy, PolicyOptions, check_policy, get_policy, uses_importance

if TYPE_CHECKING:
    from maskkv_cli.models.checkpoint import ModelFolder

__all__ = ["CacheConfig", "CachePlan", "check_layer_budgets", "plan_cache", "resolve_importance"]


def check_layer_budgets(mode: str) -> str:
    """``--layer-budgets``: one of ``auto``, ``online``, ``uniform``."""
    if mode not in LAYER_BUDGET_CHOICES:
        raise UsageError(f"--layer-budgets must be {', '.join(LAYER_BUDGET_CHOICES[:-1])} or "
                         f"{LAYER_BUDGET_CHOICES[-1]}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class CacheConfig:
    """What a run asks of the prompt cache, before it meets a prompt."""

    policy: str = DEFAULT_POLICY
    budget: int | None = None  # entries per head per layer; None with no ratio: the default for evicting policies
    ratio: float | None = None  # the budget as a share of the prompt
    options: PolicyOptions = PolicyOptions()
    layer_budgets: str = "auto"  # MaskKV: auto (calibration profile if any), online, uniform

    def __post_init__(self) -> None:
        if not isinstance(self.options, PolicyOptions):  # (None or a dict failed at the first prompt, deep inside)
            raise TypeError(f"CacheConfig: options must be a PolicyOptions (e.g. PolicyOptions(alpha=0.2)), got "
                            f"{type(self.options).__name__}")
        if self.budget is not None and self.ratio is not None:
            raise UsageError("give either --budget or --ratio, not both")
        if self.budget is not None:
            check_budget(self.budget)
        if self.ratio is not None:
            check_ratio(self.ratio)
        check_layer_budgets(self.layer_budgets)
        check_policy(self.policy)

    def resolved_budget(self, prompt_len: int) -> int | None:
        """Budget in entries per head per layer; None keeps the whole prompt."""
        if self.budget is None and self.ratio is None:
            return None
        return resolve_budget(self.budget, self.ratio, prompt_len)


@dataclass(frozen=True)
class CachePlan:
    """How one generation runs its prompt cache (see the module doc)."""

    policy: Policy
    budget: int | None  # entries per head per layer asked for (None: keep the whole prompt)
    prompt_len: int  # tokens of the prompt
    # prompt positions that are cached: prompt_len - logit_shift (Dream's last token runs with masks); for a
    # block-causal model the prompt's whole blocks (its tail shares the first response block with the masks)
    split: int
    layer_budgets: tuple[int, ...] | None  # the per-layer plan before the prefill; None: nothing is evicted
    online: bool  # the prefill measures this input's layer importance (and, when evicting, plans from it)
    importance_source: str | None  # profile, online, options, uniform; None: the policy does not use I(l)
    importance: tuple[float, ...] | None  # the I(l) the layer budgets come from when not measured online
    note: str | None  # one line for the user about the layer budgets, when the run evicts
    step_options: StepOptions = StepOptions()
    prefix: PrefixStore | None = None  # a block-causal model's document prefix computed before (engine/prefix.py)
    rope_factor: float = 1.0  # the RoPE base scaling of this prompt (``--long rope-scale``); 1: the model's own
    # leading prompt ids that are a document's (``pipeline.prepare``): a family that computes a document's prefix
    # once for all its questions starts from it (DiffusionGemma's encoder cache); 0: none
    document_len: int = 0

    @property
    def evicts(self) -> bool:
        return self.layer_budgets is not None

    @classmethod
    def build(cls, model: DiffusionLM, policy: Policy, budget: int | None, prompt_len: int, *,
              online: bool = False, step_options: StepOptions | None = None, importance_source: str | None = None,
              note: str | None = None, block_length: int | None = None,
              prefix: PrefixStore | None = None, rope_factor: float = 1.0, document_len: int = 0) -> CachePlan:
        """The plan for ``policy`` at ``budget`` over a prompt of ``prompt_len`` tokens.

        The run evicts when the policy evicts and the budget is below the cached segment (``prompt_len`` minus
        the model's logit shift; for a block-causal model, whose ``block_length`` the sampler uses, the prompt's
        whole blocks); a budget that covers it reproduces the full cache exactly. ``importance_source`` defaults
        to what the policy's options and ``online`` say."""
        if prompt_len < 1:
            raise UsageError("the prompt is empty")
        if model.config.block_causal:
            if not block_length:
                raise ValueError("a block-causal model's cache plan needs the sampler's block length")
            split = prompt_len // block_length * block_length  # may be 0: the first block holds the whole prompt
        else:
            split = prompt_len - model.config.logit_shift
            if policy.uses_cache and split < 1:
                raise UsageError("the prompt is too short for a prefix cache; use --policy none")
        evicts = policy.evicts and budget is not None and budget < split and bool(model.config.evicted_layers)
        n_layers = len(model.config.evicted_layers)  # the layers a policy cuts (DiffusionGemma: its full layers)
        if evicts:  # the run's own policy (PyramidKV: its window), whatever other plans share the object
            policy = policy.for_run(budget, split)  # type: ignore[arg-type]
        layer_budgets = tuple(policy.layer_budgets(n_layers, budget, split)) if evicts else None  # type: ignore[arg-type]
        importance = policy.options.importance
        if importance_source is None and policy.uses_importance:
            importance_source = "online" if online else "options" if importance is not None else "uniform"
        if prefix is not None and (not model.config.block_causal or prefix.length > split
                                   or prefix.block != block_length or not policy.uses_cache
                                   or prefix.rope_factor != rope_factor):
            prefix = None  # only a cached block-causal run over the same blocks and RoPE can start from it
        return cls(policy, budget, prompt_len, split, layer_budgets, online, importance_source,
                   None if online or importance is None else tuple(importance), note if evicts else None,
                   step_options or StepOptions(), prefix, rope_factor, min(max(document_len, 0), prompt_len))


def resolve_importance(
    model_path: str | os.PathLike[str] | ModelFolder,
    options: PolicyOptions,
    policy_name: str,
    mode: str = "auto",
) -> tuple[PolicyOptions, str | None]:
    """Options with ``importance`` set for ``mode``, and a one-line note for the user (or None).

    - ``auto``: the model's calibration profile if there is a usable one, else uniform layer budgets. An
      ``importance`` already set in ``options`` is kept as it is.
    - ``uniform``: uniform layer budgets (``importance`` None), no note.
    - ``online``: ``importance`` None (the plan stays uniform); the caller must run the prefill with
      ``online_importance=True`` so that the budgets come from the current input.
    Only the policies that use layer importance (``maskkv`` and its variants) read it; for the others
    ``options`` come back unchanged, no note. ``model_path``: a ``ModelFolder`` (a session's: nothing is resolved
    or hashed again per prompt), or a path, resolved here.
    """
    check_layer_budgets(mode)
    if not uses_importance(policy_name):
        return options, None
    if mode == "uniform":
        return replace(options, importance=None), None
    if mode == "online":
        return replace(options, importance=None), (
            "layer budgets from this input's own layer importance (online): the full prompt K/V of every layer "
            "stays resident during the prefill")
    if options.importance is not None:
        return options, None
    from maskkv_cli.models.calibration import find_profile, profile_path
    from maskkv_cli.models.checkpoint import ModelFolder

    model = ModelFolder.of(model_path)  # resolved once for the path and the profile
    path = profile_path(model)
    profile, reason = find_profile(model)
    if profile is not None:
        return replace(options, importance=profile.importance), f"using calibration profile {path} for layer budgets"
    if reason is not None:
        return options, (f"ignoring calibration profile {path}: {reason}; uniform layer budgets "
                         f"({calibrate_hint(model)} to redo it)")
    from maskkv_cli.models.catalog import is_embedded_model

    if is_embedded_model(str(model.path)):  # measured: a profile costs it its needles at small budgets
        return options, ("no calibration profile for this model: uniform layer budgets, which keep the embedded "
                         "model's needles better than its calibrated profile at small budgets (docs/tiny-model.md)")
    return options, (f"no calibration profile for this model: uniform layer budgets ({calibrate_hint(model)} to "
                     "create one)")


def calibrate_hint(model: ModelFolder) -> str:
    """The command that makes ``model``'s calibration profile. The embedded model, where no other default model is
    configured, is what ``maskkv calibrate`` alone calibrates: its folder inside the installed package is no name to
    type. Any other model is named as it was given."""
    from maskkv_cli.errors import MaskKVError
    from maskkv_cli.models.catalog import is_embedded_model

    try:
        configured = configured_model()
    except MaskKVError:  # a config file the command line refuses: no reason to fail a library call over a hint
        configured = None
    if is_embedded_model(str(model.path)) and not configured:
        return "run `maskkv calibrate`"
    return f"run `maskkv calibrate --model {model.name}`"


ImportanceChoice = tuple[PolicyOptions, str | None, str | None]  # (policy options, importance source, note)


def importance_choice(model_path: str | os.PathLike[str] | ModelFolder | None,
                      cache: CacheConfig) -> ImportanceChoice:
    """(policy options, importance source, note) for the cache's ``layer_budgets`` mode (the calibration profile
    looked up where ``auto`` asks for it); the source None lets ``CachePlan.build`` name it from the options. The
    same for every prompt of one model and cache: plans made together take it once (``plan_cache``'s
    ``importance``)."""
    if not uses_importance(cache.policy):
        return cache.options, None, None
    if model_path is None:  # no folder to look a profile up in: the options' own importance, else uniform
        online = cache.layer_budgets == "online"
        return (replace(cache.options, importance=None) if online else cache.options), None, None
    options, note = resolve_importance(model_path, cache.options, cache.policy, cache.layer_budgets)
    if cache.layer_budgets == "online":
        source = "online"
    elif options.importance is None:
        source = "uniform"
    else:
        source = "options" if cache.options.importance is not None else "profile"
    return options, source, note


def plan_cache(model: DiffusionLM, cache: CacheConfig, prompt_len: int,
               model_path: str | os.PathLike[str] | ModelFolder | None = None,
               step_options: StepOptions | None = None, block_length: int | None = None,
               prefix: PrefixStore | None = None, rope_factor: float = 1.0, document_len: int = 0,
               importance: ImportanceChoice | None = None) -> CachePlan:
    """The plan for ``cache`` over a prompt of ``prompt_len`` tokens of ``model`` (loaded from ``model_path``, a
    path or the ``ModelFolder`` it was loaded from, where its calibration profile is looked up for
    ``layer_budgets="auto"``); ``rope_factor``: the prompt's RoPE
    base scaling (``--long rope-scale``); ``document_len``: its leading ids that are a document's; ``importance``:
    ``importance_choice(model_path, cache)`` where the caller made it for several prompts."""
    budget = cache.resolved_budget(prompt_len)
    options, source, note = importance if importance is not None else importance_choice(model_path, cache)
    policy = get_policy(cache.policy, options)
    if budget is None and policy.evicts:
        budget = DEFAULT_BUDGET
    return CachePlan.build(model, policy, budget, prompt_len, online=cache.layer_budgets == "online"
                           and policy.uses_importance, step_options=step_options, importance_source=source,
                           note=note, block_length=block_length, prefix=prefix, rope_factor=rope_factor,
                           document_len=document_len)
