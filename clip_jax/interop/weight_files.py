"""OpenCLIP <-> clip_jax weight files: reading, writing and converting them.

`read_arrays` (`clip_jax.interop.array_files`) / `write_open_clip` read and write an OpenCLIP state_dict,
`save_params` / `load_params` / `load_variables` clip_jax's `.npz` (loading converts an OpenCLIP checkpoint on the
fly). The command line

    python -m clip_jax.convert SRC DST --model ViT-L-14

reads an OpenCLIP checkpoint (`.pt`/`.pth`/`.bin` through torch when installed, `.safetensors`, `.npz`) and writes
clip_jax params (`.npz`), or, when SRC holds clip_jax params, writes an OpenCLIP state_dict (`.safetensors`, `.npz`,
or `.pt` through torch). A file is replaced only when clip_jax wrote it (`clip_jax.runtime.ownership`).
"""

import argparse
import sys
from collections.abc import Mapping

import numpy as np

from clip_jax.errors import InvalidInput, require_extra
from clip_jax.interop.array_files import holds_clip_jax, read_arrays, unflatten, write_safetensors
from clip_jax.interop.convert import (_flatten, _refuse_resnet, from_open_clip, to_open_clip, variables_from_open_clip,
                                      variables_to_open_clip)
from clip_jax.interop.opener import WeightsFile, model_source
from clip_jax.models.config import is_resnet
from clip_jax.models.registry import get_model_config
from clip_jax.runtime import entry, ownership


def save_params(path: str, params) -> None:
    """clip_jax params (or any nested dict of arrays, such as a ResNet model's variables) as an `.npz` of
    '/'-joined paths."""
    if not path.endswith(".npz"):
        raise InvalidInput(f"clip_jax params are written as .npz; got {path}")
    _claim(path)
    np.savez(path, **{"/".join(p): np.asarray(v) for p, v in _flatten(params).items()})


def load_params(path: str, name_or_config=None) -> dict:
    """clip_jax params from an `.npz` written by `save_params`, or converted on the fly from an OpenCLIP checkpoint
    (which needs `name_or_config`)."""
    if name_or_config is not None:
        _refuse_resnet(get_model_config(name_or_config), "load_params", "load_variables")
    arrays = read_arrays(path)
    if holds_clip_jax(arrays):
        params = unflatten(arrays)
        if name_or_config is not None:
            to_open_clip(params, name_or_config)  # validates the tree against the model, naming any bad key
        return params
    if name_or_config is None:
        raise InvalidInput(f"{path} holds an OpenCLIP state_dict; pass the model name to convert it")
    return from_open_clip(arrays, name_or_config)


def load_variables(path: str, name_or_config) -> dict:
    """clip_jax variables (`params`, and `batch_stats` for a ResNet image tower) from an `.npz` written by
    `save_params` (a variables tree, or a ViT model's params), or converted from an OpenCLIP checkpoint."""
    config = get_model_config(name_or_config)
    arrays = read_arrays(path)
    if not holds_clip_jax(arrays):
        return variables_from_open_clip(arrays, config)
    tree = unflatten(arrays)
    variables = tree if "params" in tree else {"params": tree}
    variables_to_open_clip(variables, config)  # validates the tree against the model, naming any bad key
    return variables


def _claim(path: str) -> None:
    ownership.claim_file(path, writing="the weights", change="give another output path")


def write_open_clip(path: str, state_dict: Mapping[str, np.ndarray]) -> None:
    """`state_dict` as a `.safetensors`, `.npz` or torch file (a file of the same name is replaced only when clip_jax
    wrote it)."""
    if not path.endswith((".safetensors", ".npz", ".pt", ".pth", ".bin")):
        raise InvalidInput(f"unknown output format {path}: expected .safetensors, .npz, .pt, .pth or .bin")
    _claim(path)
    if path.endswith(".safetensors"):
        write_safetensors(path, state_dict)
    elif path.endswith(".npz"):
        np.savez(path, **state_dict)
    else:
        require_extra("torch", None, f"writing {path}", alternative="write .safetensors or .npz")
        import torch

        torch.save({k: torch.from_numpy(np.array(v, order="C")) for k, v in state_dict.items()}, path)


@entry.command(stopped="before the weights were written")
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="OpenCLIP checkpoint (.pt/.pth/.bin/.safetensors/.npz) or clip_jax params .npz")
    parser.add_argument("dst", help="clip_jax params (.npz), or an OpenCLIP state_dict when SRC is clip_jax params")
    parser.add_argument("--model", required=True, help="model name (e.g. ViT-L-14) or OpenCLIP model-config .json")
    args = parser.parse_args(argv)
    source = model_source(args.src)
    if not isinstance(source, WeightsFile):
        raise InvalidInput(f"{args.src} is {source.kind}: convert takes a weights file; write a run's or a "
                           "folder's weights with python -m clip_jax.export")
    if source.holds_clip_jax():
        write_open_clip(args.dst, variables_to_open_clip(load_variables(args.src, args.model), args.model))
        direction = "clip_jax -> OpenCLIP"
    else:
        variables = variables_from_open_clip(source.arrays, args.model)
        # a ViT model's file holds its params alone; a ResNet model's, both collections under their names
        save_params(args.dst, variables if is_resnet(get_model_config(args.model)) else variables["params"])
        direction = "OpenCLIP -> clip_jax"
    print(f"{direction}: {args.src} -> {args.dst} ({args.model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
