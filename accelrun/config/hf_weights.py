"""Which safetensors file holds each tensor of a Hugging Face folder (no torch): training checks it
before a run directory exists, ``validate`` checks the same, and the loader reads from it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from accelrun.errors import UserError

INDEX = "model.safetensors.index.json"
# A safetensors file: an 8-byte little-endian header length, a JSON header (tensor name ->
# dtype, shape, data_offsets into the bytes after it, plus an optional "__metadata__"), the bytes.
HEADER_LENGTH = struct.Struct("<Q")
MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit


class HFCheckpointError(UserError, ValueError):
    """A Hugging Face folder whose weights do not fit the model; names the file and tensor."""


def weight_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, else every file's header)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise HFCheckpointError(f"{index}: not a safetensors index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise HFCheckpointError(f"{index} names {missing[0]}, which is not in {folder} (a missing shard)")
        return {name: folder / f for name, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"model.hf: {folder} holds no *.safetensors files")
    out = {}
    for f in files:
        out.update(dict.fromkeys(tensor_names(f), f))
    return out


def tensor_names(file: Path) -> list[str]:
    """The tensors a safetensors file's header lists; a damaged header or a file shorter than the
    header says is an error naming the file (read here in Python: no torch, no tensor bytes)."""
    try:
        with open(file, "rb") as f:
            (length,) = HEADER_LENGTH.unpack(f.read(HEADER_LENGTH.size))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, AttributeError) as e:
        raise HFCheckpointError(f"{file}: cannot read its safetensors header ({e})") from None
    size = file.stat().st_size
    if HEADER_LENGTH.size + length + end > size:
        raise HFCheckpointError(f"{file}: cannot read its safetensors header (it lists "
                                f"{HEADER_LENGTH.size + length + end} bytes, the file has {size}: truncated?)")
    return list(header)
