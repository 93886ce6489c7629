"""Settings: the policy, budget and layer-budget defaults, the real model every hint names, and the user's own
default model and weight quantization (``MASKKV_MODEL`` / ``MASKKV_QUANTIZE`` or the config file).

A leaf: it imports no stage of the flow. Which model a run uses when ``--model`` is not given (the user's default,
else the embedded tiny model, else a random demo model) is ``models.catalog.resolve_default_model``.
"""

from __future__ import annotations

import os
import tomllib

from maskkv_cli.errors import UsageError, reason
from maskkv_cli.paths import config_file

# The policy of ask, summarize, generate, profile, demo and ``CacheConfig`` without --policy, and the reference of
# ``bench quality``'s task-by-task comparison: the paper's MaskKV as published, so that numbers compare with the
# paper's tables. Our variants (``maskkv-plus`` and others) are opt-in; docs/policies.md says why.
DEFAULT_POLICY = "maskkv"
# Entries per head per layer an evicting policy keeps when no --budget / --ratio is given.
DEFAULT_BUDGET = 256
# What --layer-budgets takes: the calibration profile if any (auto), measured on the input (online), uniform.
LAYER_BUDGET_CHOICES = ("auto", "online", "uniform")

# The real checkpoint every hint names, and the command that fetches it.
REAL_MODEL = "GSAI-ML/LLaDA-8B-Instruct"
PULL_HINT = f"maskkv pull {REAL_MODEL}"


# What --dtype takes besides auto (``models.loading.DTYPES`` maps each to its torch dtype).
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")

# Weight quantization (--quantize, ``quantize = "..."`` in the config file): none, or torchao's weight-only int8 / int4
# of the linear layers and experts (models/quantize.py).
QUANTIZE_CHOICES = ("none", "int8", "int4")


CONFIG_KEYS = ("model", "quantize")  # what the config file may set
CONFIG_EXAMPLES = {"model": REAL_MODEL, "quantize": "int8"}


def _config_value(name: str) -> str | None:
    """``name = ...`` in the config file, as text (None when the file or the line is not there)."""
    path = config_file()
    if path.is_dir():
        raise UsageError(f"config file {path} is a folder; point MASKKV_CONFIG at a TOML file")
    if not path.is_file():
        return None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # (a UTF-8 mark, as some editors write, read)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read config file {path}: {reason(exc)} (it must be UTF-8 TOML)") from None
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:  # a setting the user expects to apply, silently not read, would be worse than stopping
        raise UsageError(f"config file {path}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not "
                         f"read by maskkv; it reads {' and '.join(CONFIG_KEYS)} (the rest are command options)")
    if name not in data:
        return None
    value = data[name]
    if not isinstance(value, str) or not value.strip():  # ``model = 5`` or ``model = ""`` is a mistake, not a default
        raise UsageError(f"config file {path}: {name} must be a non-empty string in quotes, e.g. {name} = "
                         f"\"{CONFIG_EXAMPLES[name]}\"; got {value!r}")
    return value


def _setting(variable: str, key: str) -> tuple[str, str] | None:
    """A default the user set and where, as a message names it: the environment ``variable`` (``NAME=VALUE``), else
    ``key = ...`` in the config file (its line and the file); None where neither sets it."""
    if os.environ.get(variable):
        value = os.environ[variable]
        return value, f"{variable}={value}"
    value = _config_value(key)
    return None if value is None else (value, f'`{key} = "{value}"` in {config_file()}')


def configured_model() -> str | None:
    """``MASKKV_MODEL``, else ``model = ...`` in the config file, else None."""
    setting = _setting("MASKKV_MODEL", "model")
    return None if setting is None else setting[0]


def model_origin() -> str | None:
    """Where the user's default model (``configured_model``) is set, as a message names it: ``MASKKV_MODEL=X``, else
    the config file's line; None where neither sets one."""
    setting = _setting("MASKKV_MODEL", "model")
    return None if setting is None else setting[1]


def check_quantize(value: str, where: str = "--quantize") -> str:
    """``value`` when it is one of ``QUANTIZE_CHOICES`` (``where``: how the message names its origin)."""
    if value not in QUANTIZE_CHOICES:
        raise UsageError(f"{where}: unknown quantization {value!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    return value


def check_dtype(value: str) -> str:
    """``value`` when --dtype takes it (auto or one of ``DTYPE_NAMES``)."""
    if value != "auto" and value not in DTYPE_NAMES:
        raise UsageError(f"--dtype: unknown dtype {value!r}; choose one of auto, {', '.join(DTYPE_NAMES)}")
    return value


def configured_quantize() -> str:
    """The user's default quantization (``MASKKV_QUANTIZE``, else the config file's), else "none"; checked, the
    message naming where a bad value was set."""
    setting = _setting("MASKKV_QUANTIZE", "quantize")
    return "none" if setting is None else check_quantize(*setting)


def quantize_origin(given: str | None) -> str:
    """Where a run's quantization was set, as a message names it: ``--quantize X`` (``given``), else
    ``MASKKV_QUANTIZE=X`` or the config file's line (a refusal then points at what the user wrote)."""
    if given is not None:
        return f"--quantize {given}"
    setting = _setting("MASKKV_QUANTIZE", "quantize")
    return "--quantize none" if setting is None else setting[1]


def resolve_quantize(given: str | None) -> str:
    """The weight quantization of a run: ``--quantize`` when given, else the user's default
    (``configured_quantize``)."""
    return configured_quantize() if given is None else check_quantize(given)
