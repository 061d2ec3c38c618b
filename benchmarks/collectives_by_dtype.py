"""What a planned step's collectives carry: the planner's per-device counts and bytes, split by element type.

    python benchmarks/collectives_by_dtype.py [--config configs/rn50x4_laion2b.py] [--gpu a100-40gb] [--gpus 8]
                                              [--batch 224]

`python -m clip_jax.plan` reports each kind of collective's count and bytes, not what they move. This compiles the
same step (the planner's `planned_spec`, deviceless XLA:GPU, one node of `--gpus`) at per-device batch `--batch` and
counts its collectives as the planner does, once per element type (bf16 / f32 / s32 buffers), and prints the shapes
of the all-gathers and reduce-scatters. Buffers whose size follows the global batch (gathered features) change with
`--gpus`; the gradients' do not.
"""

import argparse
import importlib.util
import re

from clip_jax.runtime import xla_gpu

_COLLECTIVE = re.compile(r"= (.+?) (all-gather|reduce-scatter|all-reduce)(-start)?\(")
_DTYPE = re.compile(r"\b(bf16|f16|f32|s32)\[")


def only_dtype(hlo_text: str, dtype: str) -> str:
    """`hlo_text` with every collective whose result holds no `dtype` buffer renamed, so the planner's count skips
    it."""
    lines = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match and dtype not in _DTYPE.findall(match[1]):
            line = line.replace(f" {match[2]}{match[3] or ''}(", f" other-{match[2]}(")
        lines.append(line)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/rn50x4_laion2b.py")
    parser.add_argument("--gpu", default="a100-40gb")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--batch", type=int, default=224, help="per-device batch")
    args = parser.parse_args()
    xla_gpu.prepare()  # before JAX loads its plugins

    from clip_jax.plan.steps import compile_train_step, planned_spec
    from clip_jax.runtime.hardware import GPUS
    from clip_jax.runtime.mesh import create_mesh

    module_spec = importlib.util.spec_from_file_location("config", args.config)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    mesh = create_mesh(xla_gpu.devices(GPUS[args.gpu], 1, args.gpus))
    text = compile_train_step(planned_spec(module.get_config(), compiler="gpu"), mesh, args.batch).as_text()
    mib = lambda c: ", ".join(f"{k} {c.count[k]} ({c.bytes[k] / 2**20:.2f} MiB)"  # noqa: E731
                              for k in xla_gpu.COLLECTIVES if c.count[k])
    print(f"{args.gpus} x {args.gpu}, per-device batch {args.batch}: {mib(xla_gpu.collectives(text))}")
    for dtype in ("bf16", "f16", "f32", "s32"):
        split = xla_gpu.collectives(only_dtype(text, dtype))
        if any(split.count.values()):
            print(f"  {dtype:>4}: {mib(split)}")
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if match and match[2] != "all-reduce":
            print(f"  {match[2]}: {match[1]}")


if __name__ == "__main__":
    main()
