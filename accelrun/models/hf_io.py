"""Hugging Face checkpoints in and out: safetensors weights into a built model, and a model's state
dict out as ``config.json`` + sharded ``*.safetensors`` (+ ``model.safetensors.index.json``).

Loading works on a whole model, a pipeline stage, or a sharded one (DTensor parameters under FSDP or
TP): each parameter is read from its file in the checkpoint's dtype, put in accelrun's layout, and
converted once into the parameter's dtype. A sharded parameter (FSDP, TP, FSDP x TP) reads only this
rank's rows and columns (safetensors' ``get_slice``; q/k rows widened to whole heads for the rotary
permutation); a shard that is not one block of the tensor would read the whole tensor and keep its
slice (``distribute_tensor`` with ``src_data_rank=None``: no communication).

Why not ``torch.distributed.checkpoint.HuggingFaceStorageReader``: it loads these folders (tried: a
whole model's tensors come back equal), but into destinations in the file's own names and layout. A
family whose layout differs (Llama's q/k rows are pair-interleaved here, half-split in HF files) would
need a staging copy in HF's layout per parameter, and an FSDP shard that splits a head cannot be
permuted on its own; reading whole-head row blocks ourselves needs neither.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accelrun.config.hf_weights import INDEX, HFCheckpointError, weight_files


@torch.no_grad()
def load_hf_weights(modules: list[nn.Module], folder: str | Path, spec: Any, args: Any) -> int:
    """Copy ``folder``'s weights into the parameters ``modules`` hold (whole models, stages or shards,
    already materialised); returns how many tensors were read."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    folder = Path(folder).expanduser()
    files = weight_files(folder)
    handles: dict[Path, Any] = {}
    read = 0
    try:
        for module in modules:
            for name, param in module.named_parameters():
                hf = spec.hf_name(name, args)
                if hf not in files:
                    if name == spec.tied_output_name and args.tie_embeddings:
                        continue
                    raise HFCheckpointError(f"model.hf: {folder}: no tensor {hf!r} (for {name}) in the weight files")
                path = files[hf]
                if path not in handles:
                    try:
                        handles[path] = safe_open(str(path), framework="pt").__enter__()
                    except Exception as e:
                        raise HFCheckpointError(f"{path}: cannot read its safetensors header ({e})") from None
                try:
                    tensor_slice = handles[path].get_slice(hf)
                    file_shape = tuple(tensor_slice.get_shape())
                except Exception as e:
                    raise HFCheckpointError(f"{path}: cannot read tensor {hf!r} ({e}); is the file truncated?") from None
                shape = tuple(param.shape)
                if file_shape != shape:
                    raise HFCheckpointError(
                        f"{path}: tensor {hf!r} has shape {file_shape}, the model built from config.json "
                        f"needs {shape} (for {name})"
                    )
                region = _local_region(param) if isinstance(param, DTensor) else None
                try:
                    if region is None:
                        t = spec.hf_from_tensor(name, tensor_slice[:], args)
                    else:
                        t = _read_region(tensor_slice, region, spec.hf_row_block(name, args),
                                         lambda block, name=name: spec.hf_from_tensor(name, block, args))
                except Exception as e:  # a truncated file fails here
                    raise HFCheckpointError(f"{path}: cannot read tensor {hf!r} ({e}); is the file truncated?") from None
                if region is not None:
                    param.to_local().copy_(t)  # the one dtype conversion, of this rank's part only
                elif isinstance(param, DTensor):  # a placement _local_region does not handle: slice locally
                    t = distribute_tensor(t.to(param.device, param.dtype), param.device_mesh, param.placements,
                                          src_data_rank=None)
                    param.to_local().copy_(t.to_local())
                else:
                    param.copy_(t)  # the one dtype conversion
                read += 1
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return read


def _local_region(param: Any) -> tuple[slice, ...] | None:
    """The slice of the whole tensor this rank's shard of DTensor ``param`` holds, or None where the shard
    is not one block of it (the caller then reads the whole tensor and keeps its part).

    Each sharded dimension's global indices come from DTensor itself: an index vector along that
    dimension, laid out with the parameter's placements (no communication). That covers FSDP x TP's
    strided shards too, which are one block of rows whenever both split the same dimension evenly.
    """
    from torch.distributed.tensor import Replicate, distribute_tensor

    region = []
    for dim, size in enumerate(param.shape):
        if not any(getattr(p, "dim", None) == dim for p in param.placements):
            region.append(slice(0, size))
            continue
        shape = [1] * param.ndim
        shape[dim] = size
        placements = [p if getattr(p, "dim", None) == dim else Replicate() for p in param.placements]
        index = torch.arange(size).view(shape)
        local = distribute_tensor(index, param.device_mesh, placements, src_data_rank=None).to_local().flatten()
        if local.numel() == 0:
            region.append(slice(0, 0))
        elif torch.equal(local, torch.arange(int(local[0]), int(local[0]) + local.numel())):
            region.append(slice(int(local[0]), int(local[0]) + local.numel()))
        else:
            return None
    return tuple(region)


def _read_region(tensor_slice: Any, region: tuple[slice, ...], row_block: int, convert) -> torch.Tensor:
    """Read only ``region`` of a safetensors tensor (rows widened to whole blocks of ``row_block`` rows,
    converted by ``convert``, then cut back)."""
    rows = region[0]
    start = rows.start - rows.start % row_block
    stop = -(-rows.stop // row_block) * row_block
    block = tensor_slice[(slice(start, stop), *region[1:])]
    return convert(block)[rows.start - start: rows.stop - start]


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # transformers' shard names


def export_hf(state_dict: dict[str, torch.Tensor], spec: Any, args: Any, out: str | Path,
              max_shard_bytes: int = 2 * 2**30, removed: list[Path] | None = None) -> list[Path]:
    """Write ``state_dict`` (a whole model's, plain tensors, accelrun names) as a transformers folder:
    config.json and safetensors shards of at most ``max_shard_bytes`` each (one tensor may exceed
    it), with an index when there is more than one. Returns the files written. Weight files of an
    earlier export into ``out`` that this one does not overwrite are deleted (appended to ``removed``):
    transformers reads a lone model.safetensors before an index, so an old one would be loaded."""
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    hf_sd = spec.state_dict_to_hf({k: v.detach().cpu() for k, v in state_dict.items()}, args)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf_sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    written = []
    config = spec.hf_config(args)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    written.append(out / "config.json")
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        _as_umask_allows(out / fname)
        written.append(out / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in hf_sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX)
    for stale in sorted({*out.glob("model*.safetensors"), out / INDEX} - set(written)):
        if stale.is_file() and (stale.name in ("model.safetensors", INDEX) or SHARD_NAME.fullmatch(stale.name)):
            stale.unlink()
            if removed is not None:
                removed.append(stale)
    return written


def _as_umask_allows(path: Path) -> None:
    """The mode any new file of this process gets (0644 under the usual umask 022). safetensors writes its
    files 0600, so an export was readable by its owner alone: not by a serving job or a colleague."""
    path.chmod(0o666 & ~_umask())


def _umask() -> int:
    # Read, not set-and-restore where Linux says it: os.umask changes it for every thread of the process
    # (a checkpoint writer's files created meanwhile would get mode 0666).
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_hf_for_config(modules: list[nn.Module], cfg: Any) -> int:
    """Read ``cfg.hf``'s weights (a recipe's ``model`` section) into ``modules``, by its family's names."""
    from accelrun.models.families import get_family

    spec = get_family(cfg.arch)
    return load_hf_weights(modules, cfg.hf, spec, spec.args_from_config(cfg))
