"""Files of named arrays: OpenCLIP state_dicts (`.pt`/`.pth`/`.bin` through torch, `.safetensors`, `.npz`) and
clip_jax's params (`.npz` of '/'-joined names), read as name -> array (`read_arrays`), told apart (`holds_clip_jax`)
and nested (`unflatten`); `write_safetensors` writes a `.safetensors` file. What they hold is read as a model by
`clip_jax.interop.opener`, converted by `clip_jax.interop.weight_files`.
"""

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from clip_jax.errors import InvalidInput, MissingInput, require_extra


def _torch_state_dict(path: str) -> dict[str, np.ndarray]:
    require_extra("torch", None, f"reading {path}", alternative="give the weights as .safetensors")
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except RuntimeError:  # OpenAI's original checkpoints are TorchScript archives
        obj = torch.jit.load(path, map_location="cpu").state_dict()
    if isinstance(obj, Mapping) and "state_dict" in obj:  # an OpenCLIP training checkpoint
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"{path} does not hold a state_dict (found {type(obj).__name__})")
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in obj.items()
            if isinstance(v, torch.Tensor)}


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """Name -> array from a `.pt`/`.pth`/`.bin` (torch), `.safetensors` or `.npz` file."""
    if not os.path.exists(path):
        raise MissingInput(f"checkpoint {path} does not exist")
    if path.endswith((".pt", ".pth", ".bin")):
        return _torch_state_dict(path)
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return load_file(path)
        except SafetensorError as e:
            raise InvalidInput(f"{path} is not a readable safetensors file ({e}): it is damaged or cut short; "
                               "download or export it again") from None
    if path.endswith(".npz"):
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    raise InvalidInput(f"unknown checkpoint format {path}: expected .pt, .pth, .bin, .safetensors or .npz")


def unflatten(arrays: Mapping[str, Any]) -> dict:
    """The nested dict of a file's '/'-joined names (clip_jax's `.npz` of params or variables)."""
    tree: dict = {}
    for key, value in arrays.items():
        *parents, leaf = key.split("/")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def holds_clip_jax(arrays: Mapping[str, Any]) -> bool:
    """Whether a file's arrays are clip_jax's params or variables ('/'-joined names), not an OpenCLIP state_dict."""
    return any("/" in k for k in arrays)


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "bfloat16": "BF16", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path: str, arrays: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """`arrays` as a `.safetensors` file, each array's bytes written straight from its buffer (no copy of the
    whole state_dict in memory, as `safetensors.numpy.save_file` makes). The caller claims `path`."""
    arrays = {name: np.asarray(value) for name, value in arrays.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, value in arrays.items():
        if value.dtype.name not in _SAFETENSORS_DTYPES:
            raise InvalidInput(f"{name}: dtype {value.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[value.dtype.name], "shape": list(value.shape),
                        "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for value in arrays.values():
            if value.dtype.byteorder == ">":
                value = value.astype(value.dtype.newbyteorder("<"))
            f.write(memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
