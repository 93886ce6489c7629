"""Local checkpoints in their upstream layouts: resolve, validate, load without a second copy, save.

A folder holds ``config.json`` (a ``model_type`` of the family table, ``models/families.py``), weights as
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, and tokenizer files. Nothing here reaches
the network: a Hugging Face id is looked up in the local HF cache only (``paths.resolve_model_path``; ``maskkv pull``,
``models/hub.py``, puts it there).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from maskkv_cli.errors import ModelLoadError, reason
from maskkv_cli.models import rows
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.diffusion_gemma import DiffusionGemma
from maskkv_cli.models.diffusion_gemma import checkpoint_shapes as diffusion_gemma_shapes
from maskkv_cli.models.families import build_model, config_from_hf, config_to_hf, family, parameter_shapes
from maskkv_cli.models.meta import meta_device
from maskkv_cli.models.prequantized import PreQuantized, TorchaoShard, check_request, read_prequantized
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.models.quantize import loading_quantizer, mark_prequantized
from maskkv_cli.paths import resolve_model_path
from maskkv_cli.runtime.allocator import small_blocks_mapped

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device | str = "cpu",
                quantize: str | None = None) -> torch.dtype:
    """``auto``/None: fp32 on the CPU, bf16 on any other device; bf16 on the CPU too for int4 weights
    (``quantize``), whose CPU kernel (``aten._weight_int4pack_mm_for_cpu``) takes fp32 activations on a slow path
    (50-80x the time of the unquantized fp32 product on this project's AMD EPYC CPU, against 1.7-2.4x in bf16;
    docs/models.md)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():  # (torch.int8 failed in torch.finfo; int8 weights are --quantize's)
            raise ModelLoadError(f"dtype {dtype} is not one the model runs in: choose one of "
                                 f"{', '.join(str(d) for d in dict.fromkeys(DTYPES.values()))} (quantize='int8' "
                                 "quantizes the weights)")
        return dtype
    if dtype in (None, "auto"):
        cpu = torch.device(device).type == "cpu"
        return torch.float32 if cpu and quantize != "int4" else torch.bfloat16
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}") from None


def read_config(folder: Path) -> ModelConfig:
    return read_folder_config(folder)[0]


def read_folder_config(folder: Path) -> tuple[ModelConfig, PreQuantized | None]:
    """The model's config and the checkpoint's own quantization (``models/prequantized.py``), from one parse of
    config.json."""
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {reason(exc)}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{folder / 'config.json'} is not a model config (a JSON object), it holds a "
                             f"{type(data).__name__}")
    pre = read_prequantized(folder, data)
    data = {**_generation_ids(folder), **data}  # config.json's own ids win
    return config_from_hf(data, source=str(folder / "config.json")), pre


class _ReadIt:
    """``load_checkpoint``'s default for ``prequantized``: read it from the folder's config.json."""


READ_IT = _ReadIt()


ID_FIELDS = ("mask_token_id", "eos_token_id", "bos_token_id", "pad_token_id")


def _generation_ids(folder: Path) -> dict[str, object]:
    """Special token ids from ``generation_config.json`` (LLaDA2 configs carry none of their own)."""
    try:
        data = json.loads((folder / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: data[k] for k in ID_FIELDS if isinstance(data, dict) and data.get(k) is not None}


def weight_files(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> file that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {index}: {reason(exc)}") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ModelLoadError(f"{folder}: shard files listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with open_weights(single) as f:
            return dict.fromkeys(f.keys(), single)
    raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; the folder holds no weights")


def open_weights(file: Path, device: str = "cpu") -> Any:
    """``safe_open`` on a weights file, a damaged or cut-short one (an interrupted download) refused in one line
    that names it."""
    try:
        return safe_open(str(file), framework="pt", device=device)
    except Exception as exc:  # safetensors' own error type (a Rust exception), or an OSError
        raise ModelLoadError(f"cannot read the weights file {file} ({reason(exc)}): it is damaged or incomplete; "
                             "download it again") from None


def _safetensors_device(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def _names(keys: Iterable[str], limit: int = 6) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_keys(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], where: str) -> None:
    missing = expected.keys() - found.keys()
    unexpected = found.keys() - expected.keys()
    wrong = [f"{k} {list(found[k])} (expected {list(expected[k])})" for k in sorted(expected.keys() & found.keys())
             if tuple(found[k]) != tuple(expected[k])]
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    if wrong:
        problems.append(f"mis-shaped: {_names(wrong, 3)}")
    if problems:
        raise ModelLoadError(f"checkpoint {where} does not match its config.json; " + "; ".join(problems))


def scan_shapes(files: dict[str, Path], torchao: bool = False
                ) -> tuple[dict[str, tuple[int, ...]], dict[Path, TorchaoShard]]:
    """Every tensor's shape from the files' headers, by checkpoint key; ``torchao``: a pre-quantized checkpoint's
    files, whose quantized tensors are listed by their own names (not their parts') with each file's
    ``TorchaoShard`` (a class maskkv does not run is refused here, before any weight is read)."""
    found: dict[str, tuple[int, ...]] = {}
    shards: dict[Path, TorchaoShard] = {}
    for file in sorted(set(files.values())):
        with open_weights(file) as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            if torchao:
                shard = shards[file] = TorchaoShard(f.metadata())
                shard.check(file)
                for name, keys in shard.names.items():
                    for key in keys:
                        if key.endswith("_qdata") and key in shapes:
                            found[name] = shapes[key]  # an Int8Tensor's shape is its values'
                        shapes.pop(key, None)
            found.update(shapes)
    return found, shards


def load_model(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    quantize: str | None = None,
) -> DiffusionLM:
    """Build the model (its family from ``config.json``, ``models/families.py``) on the meta device and load each tensor
    straight into place (no random init, no second copy). ``quantize`` ("int8", "int4"): each linear layer is quantized
    as soon as it is read (``models/quantize.py``), so the full-precision model is never resident."""
    folder = resolve_model_path(path)
    cfg, pre = read_folder_config(folder)
    return load_checkpoint(folder, cfg, device, dtype, quantize, pre)


def check_prequantized(folder: Path, cfg: ModelConfig, pre: PreQuantized | None, quantize: str | None) -> str | None:
    """The quantization a load runs (``prequantized.check_request``): a pre-quantized checkpoint's own, else
    ``quantize``; one maskkv does not run is refused, as is any of a family with its own layout (DiffusionGemma's
    3-D experts: no pre-quantized form of them is read)."""
    if pre is not None and family(cfg.family).loader != "standard":
        raise ModelLoadError(f"{folder} holds pre-quantized weights ({pre.detail}); maskkv loads {cfg.family} "
                             "checkpoints in fp32 / bf16 / fp16: load the model's bf16 release (--quantize int8|int4 "
                             "quantizes it as it loads)")
    return check_request(pre, folder, quantize)


def load_checkpoint(folder: Path, cfg: ModelConfig, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype | None = None, quantize: str | None = None,
                    prequantized: PreQuantized | None | _ReadIt = READ_IT) -> DiffusionLM:
    """``load_model`` of a folder already resolved whose config was read (``models.checkpoint.ModelFolder``, which
    passes ``prequantized`` too: the checkpoint's own quantization, else read here); a family with its own
    checkpoint layout is read by its loader (``Family.loader``, ``LOADERS``).

    A checkpoint quantized before it was saved (``quantization_config``, ``models/prequantized.py``) loads as it is
    when maskkv runs its format (torchao int8), else is refused in one line before any weight is read."""
    from maskkv_cli.runtime.devices import resolve_device

    device = resolve_device(str(device))  # auto, or a device this PyTorch can use (torch's own spoke of pinned memory)
    pre = read_prequantized(folder) if isinstance(prequantized, _ReadIt) else prequantized
    quantize = check_prequantized(folder, cfg, pre, quantize)
    if quantize is None:
        return _load_checkpoint(folder, cfg, device, dtype, None, pre)
    with small_blocks_mapped():  # each freed full-precision copy back to the kernel (runtime/allocator.py)
        return _load_checkpoint(folder, cfg, device, dtype, quantize, pre)


def _load_checkpoint(folder: Path, cfg: ModelConfig, device: str | torch.device, dtype: str | torch.dtype | None,
                     quantize: str | None, pre: PreQuantized | None) -> DiffusionLM:
    loader = family(cfg.family).loader
    if loader != "standard":
        return LOADERS[loader](folder, cfg, device, dtype, quantize)  # type: ignore[return-value]
    device = torch.device(device)
    dt = parse_dtype(dtype, device, quantize)
    files = weight_files(folder)
    found, shards = scan_shapes(files, pre is not None)
    expected = parameter_shapes(cfg)
    optional = getattr(family(cfg.family).model_class, "optional_keys", ())
    left_out = [k for k in expected if k not in found and k.endswith(optional)] if optional else []
    check_keys({k: v for k, v in expected.items() if k not in left_out}, found, str(folder))
    with meta_device():
        model = build_model(cfg)
    modules = dict(model.named_modules())
    quantized = None if pre is not None else loading_quantizer(model, quantize, device, dt)
    for key in left_out:  # e.g. a router's expert bias that a checkpoint does not carry: zeros, as upstream inits it
        owner, _, leaf = model.parameter_name(key).rpartition(".")
        modules[owner]._parameters[leaf] = nn.Parameter(torch.zeros(expected[key], device=device, dtype=dt),
                                                        requires_grad=False)
    # Quantizing on the CPU, every tensor kept is the loader's own copy: a tensor read in the file's dtype is
    # otherwise a view of the file's mapping, which would keep the whole shard mapped (and the pages of the
    # layers already quantized resident) for as long as any such view lives.
    own_copy = (quantized is not None or pre is not None) and device.type == "cpu"
    parts: dict[str, dict[str, torch.Tensor]] = {}  # a quantized tensor's parts read so far
    for file in sorted(set(files.values())):
        shard = shards.get(file)
        part_of = {key: name for name, keys in shard.names.items() for key in keys} if shard else {}
        with open_weights(file, _safetensors_device(device)) as f:
            for key in f.keys():
                if key in part_of:  # a part of a pre-quantized tensor: kept as stored (int8 values, scales)
                    name = part_of[key]
                    got = parts.setdefault(name, {})
                    got[key] = f.get_tensor(key).to(device=device, copy=own_copy)
                    if len(got) == len(shard.names[name]):  # type: ignore[union-attr]
                        _set_quantized(model, modules, name, shard.build(name, parts.pop(name)), folder)  # type: ignore[union-attr]
                    continue
                owner, _, leaf = model.parameter_name(key).rpartition(".")
                tensor = f.get_tensor(key).to(device=device, dtype=dt, copy=own_copy)
                modules[owner]._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
                del tensor
                if quantized is not None:
                    quantized(owner)
                    modules[owner] = model.get_submodule(owner)  # a layer split in parts replaces the one read
                    # (dropping it here frees its full-precision weight now, not when loading ends)
    if parts:
        raise ModelLoadError(f"checkpoint {folder}: the quantized tensors {_names(parts)} miss some of their parts")
    if pre is not None:
        mark_prequantized(model, pre.mode or "none")  # and its layers read in parts split by rows
    model.eval()
    rows.prepare(model)  # the row floor's probe now, not inside the first measured step
    return model


def _set_quantized(model: nn.Module, modules: dict[str, nn.Module], name: str, weight: torch.Tensor,
                   folder: Path) -> None:
    """A pre-quantized tensor into its place: the weight of a linear layer (nothing else runs quantized)."""
    owner, _, leaf = model.parameter_name(name).rpartition(".")  # type: ignore[attr-defined]
    if not isinstance(modules.get(owner), rows.Linear) or leaf != "weight":
        raise ModelLoadError(f"checkpoint {folder}: {name} is quantized, but only linear layers' weights run "
                             "quantized in maskkv")
    modules[owner]._parameters[leaf] = nn.Parameter(weight, requires_grad=False)


def save_model(
    model: DiffusionLM,
    folder: str | os.PathLike[str],
    tokenizer: object | None = None,
    max_shard_bytes: int | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` (and ``tokenizer``) in the upstream layout; atomic: a temp folder renamed at the end."""
    target = Path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        state = {model.checkpoint_key(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = tensor
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2))
        cfg = config_to_hf(model.config)
        cfg["torch_dtype"] = str(model.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id,
               "pad_token_id": model.config.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))  # type: ignore[attr-defined]
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def diffusion_gemma_keys(cfg: ModelConfig, found: dict[str, tuple[int, ...]], where: str) -> dict[str, str]:
    """Parameter or buffer name -> the checkpoint key it is read from, for a DiffusionGemma checkpoint whose keys
    and shapes are ``found``; a key of the config's model that is missing, unexpected or mis-shaped is refused.

    The vision tower's keys are skipped (the model is text only). Text weights come from ``model.decoder.*``
    (where ``save_pretrained`` writes the tied weights), or from ``model.encoder.language_model.*`` /
    ``lm_head.weight`` when a checkpoint stores those; both sides' layer scalars are read, and one a checkpoint
    lacks stays at 1 (as transformers leaves it)."""
    expected = {DiffusionGemma.parameter_name(k): v for k, v in diffusion_gemma_shapes(cfg).items()}
    chosen: dict[str, str] = {}
    for key in sorted(found):
        name = DiffusionGemma.parameter_name(key)
        if name is None:
            continue  # the vision tower
        if name not in expected:
            raise ModelLoadError(f"checkpoint {where} does not match its config.json; unexpected key {key}")
        if name not in chosen or key.startswith("model.decoder."):  # the decoder's copy wins
            chosen[name] = key
    missing = [n for n in expected if n not in chosen and not n.endswith("layer_scalar")]
    if missing:
        raise ModelLoadError(f"checkpoint {where} does not match its config.json; missing keys: "
                             f"{_names(DiffusionGemma.checkpoint_key(n) for n in missing)}")
    for name, key in chosen.items():
        if tuple(found[key]) != expected[name]:
            raise ModelLoadError(f"checkpoint {where}: {key} is {list(found[key])}, expected {list(expected[name])}")
    return chosen


def unread_keys_note(found: dict[str, tuple[int, ...]]) -> str | None:
    """What a DiffusionGemma checkpoint holds that is never read: its vision tower."""
    vision = [k for k in found if DiffusionGemma.parameter_name(k) is None]
    if not vision:
        return None
    values = sum(math.prod(found[k]) for k in vision)
    return (f"the vision tower ({len(vision)} tensors, {values:,} values) is not read: maskkv runs the text model "
            "only")


def check_checkpoint(cfg: ModelConfig, found: dict[str, tuple[int, ...]], where: str) -> tuple[int, str | None]:
    """Whether a checkpoint's keys and shapes (``found``) are those its config's model reads: (the parameters it
    reads, a note on what it holds and never reads, or None); a mismatch is a ``ModelLoadError``."""
    if family(cfg.family).loader == "diffusion_gemma":
        chosen = diffusion_gemma_keys(cfg, found, where)
        return sum(math.prod(found[k]) for k in chosen.values()), unread_keys_note(found)
    expected = parameter_shapes(cfg)
    check_keys(expected, found, where)
    return sum(math.prod(shape) for shape in expected.values()), None


def header_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape, from the safetensors headers (no tensor is read)."""
    found: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with open_weights(file) as f:
            for key in f.keys():
                found[key] = tuple(f.get_slice(key).get_shape())
    return found


def load_diffusion_gemma(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    quantize: str | None = None,
) -> DiffusionGemma:
    """A DiffusionGemma folder as transformers saves it (``config.json`` with ``model_type: diffusion_gemma``,
    safetensors) as ``models.diffusion_gemma.DiffusionGemma``, built on the meta device and filled in place
    (``load_model`` of such a folder; the keys read: ``diffusion_gemma_keys``). ``quantize`` ("int8", "int4"):
    the attention, dense MLP and self-conditioning projections and each expert's matrices are quantized as soon as
    they are read (``models/quantize.py``), as ``load_model`` does."""
    folder = resolve_model_path(path)
    cfg, pre = read_folder_config(folder)
    if cfg.family != "diffusion_gemma":
        raise ModelLoadError(f"{folder / 'config.json'}: not a DiffusionGemma config (family {cfg.family})")
    return load_checkpoint(folder, cfg, device, dtype, quantize, pre)  # type: ignore[return-value]


def read_diffusion_gemma(folder: Path, cfg: ModelConfig, device: str | torch.device = "cpu",
                         dtype: str | torch.dtype | None = None, quantize: str | None = None) -> DiffusionGemma:
    """``load_checkpoint`` of a DiffusionGemma folder (``Family.loader``)."""
    device = torch.device(device)
    dt = parse_dtype(dtype, device, quantize)
    files = weight_files(folder)
    chosen = diffusion_gemma_keys(cfg, header_shapes(files), str(folder))
    with meta_device():
        model = DiffusionGemma(cfg)
    modules = dict(model.named_modules())
    for key in diffusion_gemma_shapes(cfg):
        name = DiffusionGemma.parameter_name(key)
        if name is not None and name not in chosen:  # a layer scalar the checkpoint lacks
            owner, _, leaf = name.rpartition(".")
            modules[owner]._buffers[leaf] = torch.ones(1, device=device, dtype=dt)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, key in chosen.items():
        by_file.setdefault(files[key], []).append((name, key))
    quantized = loading_quantizer(model, quantize, device, dt)
    own_copy = quantized is not None and device.type == "cpu"  # as in load_checkpoint: no view keeps a shard mapped
    for file, names in sorted(by_file.items()):
        with open_weights(file, _safetensors_device(device)) as f:
            for name, key in names:
                owner, _, leaf = name.rpartition(".")
                tensor = f.get_tensor(key).to(device=device, dtype=dt, copy=own_copy)
                if leaf in modules[owner]._buffers:
                    modules[owner]._buffers[leaf] = tensor
                else:
                    modules[owner]._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
                del tensor
                if quantized is not None:
                    quantized(owner)
    model.eval()
    rows.prepare(model)
    return model


# ``Family.loader`` -> the function that reads such a checkpoint (``load_checkpoint`` without the standard path)
LOADERS = {"diffusion_gemma": read_diffusion_gemma}
