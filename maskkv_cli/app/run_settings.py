"""One builder from a run's flat settings to what the engine takes: generation settings and the cache request.

The commands, batch jobs, the harness model, ``bench quality`` and ``profile`` all hold the same flat values
(policy, budget or ratio, layer budgets, lengths, sampler options, seed). ``RunSettings`` turns them into a
``GenerationConfig`` (lengths filled from the model's stored defaults, or fitted to an answer length), a
``CacheConfig`` (checked once, in its constructor) and Dream's ``DreamOptions``. The cache plan itself needs the
prompt, so the session builds it per prompt (``engine.plan.plan_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.engine.plan import CacheConfig
from maskkv_cli.errors import UsageError
from maskkv_cli.models.families import family
from maskkv_cli.policies.base import PolicyOptions
from maskkv_cli.sampling.dream import DreamOptions
from maskkv_cli.sampling.llada import GenerationConfig
from maskkv_cli.sampling.llada2 import LLaDA2Options

FLAGS = {"cfg_scale": "--cfg"}  # a setting whose flag is not its name with dashes
DEFAULT_GEN_LENGTH = 128  # response tokens when neither the user nor the model says
DEFAULT_BLOCK_LENGTH = 32


ONE_BLOCK = 0  # a default block length meaning: the whole response is one block (``resolve_generation``)


def family_defaults(generation: dict[str, int], family_name: str) -> dict[str, int]:
    """A model's stored generation defaults as its family runs them: a sampler without blocks (one that refuses
    ``--block-length``: Dream's) answers in one block, so that any ``--steps`` fits it (blocks of 32 made it refuse
    every step count that is no multiple of the length / 32)."""
    if family(family_name).one_block:
        return {**generation, "block_length": ONE_BLOCK}
    return generation


def resolve_generation(defaults: dict[str, int], gen_length: int | None, steps: int | None,
                       block_length: int | None) -> tuple[int, int, int]:
    """(gen_length, steps, block_length) from the options, filling gaps from the model's defaults
    (``ModelDefaults.generation``), else 128 / gen length / 32 (a length given without steps: one step per token);
    a default block that does not divide the length (or is ``ONE_BLOCK``) becomes one block (a block the user gave
    must divide it:
    ``GenerationConfig`` says so). Only None is a gap: a length or count of 0 stays, so that ``GenerationConfig``
    refuses it instead of a default replacing it."""
    gen = defaults.get("gen_length", DEFAULT_GEN_LENGTH) if gen_length is None else gen_length
    block = defaults.get("block_length", min(DEFAULT_BLOCK_LENGTH, gen)) if block_length is None else block_length
    if block_length is None and (block <= 0 or gen % block):
        block = gen
    if steps is None:
        steps = defaults.get("steps", gen) if gen_length is None else gen
    return gen, steps, block


def fitted_block(length: int, *blocks: int | None) -> int:
    """The first of ``blocks`` that divides ``length``, else ``length`` (one block)."""
    return next((b for b in blocks if b and length % b == 0), length)


@dataclass(frozen=True)
class RunSettings:
    """The flat settings of one run, as every entry point takes them (``None``: the model's or the default)."""

    policy: str = DEFAULT_POLICY
    budget: int | None = None
    ratio: float | None = None
    layer_budgets: str = "auto"
    seed: int = 0  # the sampler's and the ``random`` policy's
    gen_length: int | None = None
    steps: int | None = None
    block_length: int | None = None
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    alg: str = "entropy"  # Dream only
    top_p: float | None = None  # Dream and LLaDA2 (sampling with a temperature)
    top_k: int | None = None  # Dream and LLaDA2
    editing_threshold: float | None = None  # LLaDA2.1's token editing (None: the model's default, else off)
    max_post_steps: int | None = None  # LLaDA2.1 (None: the model's default, else 16)

    def __post_init__(self) -> None:
        for name in ("gen_length", "steps", "block_length"):  # None is the default; 0 must not read as one
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        self._sampler(1, 1, 1)  # the sampler's own checks (temperature, guidance, remasking, threshold), up front

    @classmethod
    def from_values(cls, values: dict[str, Any], what: str = "setting") -> RunSettings:
        """Settings given by name, their values as text or numbers (the harness's model args ``key=value``): each
        converted to its field's type (``none`` / empty: None where None is allowed); an unknown name or a value
        that is not of its type is a ``UsageError`` naming it (``what``: how the message calls a setting)."""
        known = {f.name: str(f.type) for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UsageError(f"unknown {what}{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
        return cls(**{name: _typed(name, value, known[name]) for name, value in values.items()})

    def cache(self) -> CacheConfig:
        return CacheConfig(policy=self.policy, budget=self.budget, ratio=self.ratio,
                           options=PolicyOptions(seed=self.seed), layer_budgets=self.layer_budgets)

    def dream(self) -> DreamOptions:
        return DreamOptions(alg=self.alg, top_p=self.top_p, top_k=self.top_k)

    def llada2(self, defaults: LLaDA2Options | None = None) -> LLaDA2Options:
        """LLaDA2's options: these settings where given, else ``defaults`` (the model's stored ones)."""
        base = defaults or LLaDA2Options()
        options = replace(base, top_p=self.top_p, top_k=self.top_k,
                          editing_threshold=base.editing_threshold if self.editing_threshold is None
                          else self.editing_threshold,
                          max_post_steps=base.max_post_steps if self.max_post_steps is None else self.max_post_steps)
        if self.max_post_steps is not None and options.editing_threshold is None:  # LLaDA2.0's loop never reads it
            raise UsageError("--max-post-steps applies to LLaDA2.1's token editing, which this run does not use: give "
                             "--editing-threshold too, or leave it out")
        return options

    def check_family(self, name: str) -> None:
        """Refuse, in one line, the settings given (other than their defaults) that the sampler of the model family
        ``name`` does not take (``models.families.Family.refuses``)."""
        fam = family(name)
        given = [FLAGS.get(f.name, "--" + f.name.replace("_", "-")) for f in fields(self)
                 if f.name in fam.refuses and getattr(self, f.name) != f.default]
        if given:
            verb = "is not an option" if len(given) == 1 else "are not options"
            raise UsageError(f"{', '.join(given)} {verb} of the {name} sampler (docs/models.md has what it takes)")
        for setting, value in fam.refuses_values:
            if getattr(self, setting, None) == value:
                flag = FLAGS.get(setting, "--" + setting.replace("_", "-"))
                raise UsageError(f"{flag} {value} is not available for {name} models (docs/models.md says why)")
        check_policy_family(self.policy, name)

    def generation(self, defaults: dict[str, int] | None = None) -> GenerationConfig:
        """The lengths as given, gaps filled from the model's stored defaults (``resolve_generation``)."""
        gen, steps, block = resolve_generation(defaults or {}, self.gen_length, self.steps, self.block_length)
        return self._sampler(gen, steps, block)

    def answer_generation(self, length: int, block: int | None = None) -> GenerationConfig:
        """``length`` tokens, one per step unless ``steps`` is set, in blocks of the run's block length when it
        divides the length, else of ``block`` when that does, else one block: answers whose length a task or a
        request sets (the harness, ``bench quality``'s task groups)."""
        return self._sampler(length, length if self.steps is None else self.steps,
                             fitted_block(length, self.block_length, block))

    def _sampler(self, gen_length: int, steps: int, block_length: int) -> GenerationConfig:
        return GenerationConfig(gen_length=gen_length, steps=steps, block_length=block_length,
                                temperature=self.temperature, cfg_scale=self.cfg_scale, remasking=self.remasking,
                                threshold=self.threshold, seed=self.seed)


ONE_PROMPT = ("truncate", "rope-scale")  # the --long modes of a command that measures one prompt (profile)
PROFILES_ONE_PROMPT = "profile measures one prompt (ask reads a long document in parts)"  # why it takes no other


def check_long_family(long: str, name: str, modes: tuple[str, ...] | None = None, why: str = "") -> None:
    """Refuse, in one line, a ``--long`` mode the model family ``name`` cannot run (``Family.refuses_values``), or
    one the command does not take (``modes``: those it takes, all by default; ``why``: why it takes no other); the
    message offers the modes both allow."""
    from maskkv_cli.prompting.fit import LONG_MODES

    refused = family(name).refuses_values
    allowed = " or ".join(m for m in (modes or LONG_MODES) if ("long", m) not in refused)
    if ("long", long) in refused:
        raise UsageError(f"--long {long} is not available for {name} models (docs/models.md says why); use --long "
                         f"{allowed}")
    if modes is not None and long not in modes:
        raise UsageError(f"{why}: --long {allowed}")


def check_policy_family(policy: str, name: str) -> None:
    """Refuse, in one line, a ``--policy`` the prompt cache of the model family ``name`` cannot run
    (``models.families.Family.refuses_policies``)."""
    refused = family(name).refuses_policies
    if policy in refused:
        raise UsageError(f"policy {policy} is not available for {name} models (refused: {', '.join(refused)}; "
                         "docs/models.md says why); use maskkv, a baseline, full or none")


def _typed(name: str, value: Any, kind: str) -> Any:
    """``value`` as the field type ``kind`` says (``int``, ``float``, ``str``, each ``| None`` or not)."""
    optional = kind.endswith("| None")
    base = kind.removesuffix("| None").strip()
    if base == "str" and value is not None:
        return str(value)  # a name as it is (``none`` is a policy)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise UsageError(f"{name} needs a value")
    try:
        if base == "float":
            return float(value)
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value.strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be {'a whole number' if base == 'int' else 'a number'}, got {value!r}") from None
