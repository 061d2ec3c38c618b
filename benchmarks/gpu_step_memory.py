"""ViT-L/14's bf16 train step compiled for XLA:GPU without a GPU: activation memory per device by LayerNorm/GELU
path, residual dtype and remat policy, and the gradient collectives per step by `grad_reduce_dtype`.

    python benchmarks/gpu_step_memory.py [--gpu h200] [--batch 256] [--gpus 384] [--out DIR]

Memory: one `--gpu` device, batch `--batch`, cuDNN attention, three activation paths: "autodiff" (the LayerNorms
and GELUs differentiated by autodiff, which keeps their float32 intermediates; gradients summed in bf16: the step
before lean activations), "lean" (the default: their custom VJPs keep the 16-bit input and the per-row statistics)
and "lean, f32 residual" (`residual_dtype="float32"`, the residual stream as OpenCLIP's autocast keeps it).
Collectives: the default step on `--gpus` A100-40GB (nodes of 4, FSDP off, batch 224 as the recipe), each kind's
bytes by element type, for `grad_reduce_dtype` float32 and bfloat16. Needs jaxlib's CUDA plugin
(`pip install -e '.[gpu]'`). Prints two tables and writes DIR/gpu_step_memory.json.
"""

import argparse
import dataclasses
import json
import pathlib
import time
from unittest import mock

from clip_jax.runtime import xla_gpu

xla_gpu.prepare()

import jax  # noqa: E402

from clip_jax import plan  # noqa: E402
from clip_jax.models import layers  # noqa: E402
from clip_jax.runtime.hardware import GPUS  # noqa: E402
from clip_jax.runtime.mesh import create_mesh  # noqa: E402
from clip_jax.training.step_factory import StepSpec  # noqa: E402

REMATS = ("none", "dots_saveable", "nothing_saveable")
PATHS = {  # name: (StepSpec fields, LayerNorm/GELU 16-bit path on)
    "autodiff": ({"grad_reduce_dtype": "bfloat16"}, False),
    "lean": ({}, True),
    "lean, f32 residual": ({"residual_dtype": "float32"}, True),
}


def step_memory(spec: StepSpec, mesh, batch: int, lean: bool) -> float:
    """GiB per device of the compiled step."""
    with mock.patch.object(layers, "is_16_bit", layers.is_16_bit if lean else (lambda dtype: False)):
        return plan.StepMemory.of(plan.compile_train_step(spec, mesh, batch)).total / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--gpus", type=int, default=384, help="A100s for the collectives table")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")

    mesh = create_mesh(xla_gpu.devices(GPUS[args.gpu], 1, 1))
    memory = []
    for remat in REMATS:
        for path, (fields, lean) in PATHS.items():
            spec = StepSpec.for_model("ViT-L-14", "bf16", remat, attention_impl="cudnn", **fields)
            start = time.perf_counter()
            gib = step_memory(spec, mesh, args.batch, lean)
            memory.append({"remat": remat, "path": path, "gib": gib, "compile_s": time.perf_counter() - start})
            print(f"compiled {remat} / {path}: {gib:.2f} GiB", flush=True)

    a100s = create_mesh(xla_gpu.devices(GPUS["a100-40gb"], args.gpus // 4, 4))
    collectives = []
    for reduce_dtype in ("float32", "bfloat16"):
        spec = StepSpec.for_model("ViT-L-14", "bf16", "nothing_saveable", attention_impl="cudnn",
                                  grad_reduce_dtype=reduce_dtype)
        moved = xla_gpu.collectives(plan.compile_train_step(spec, a100s, 224).as_text())
        collectives.append({"grad_reduce_dtype": reduce_dtype, **dataclasses.asdict(moved)})
        print(f"compiled grad_reduce_dtype={reduce_dtype} on {args.gpus} A100s", flush=True)

    lines = [f"ViT-L/14 bf16, cuDNN attention, batch {args.batch}, one {args.gpu} (GiB per device)",
             f"{'remat':<18}" + "".join(f"{p:>22}" for p in PATHS)]
    for remat in REMATS:
        row = {r["path"]: r["gib"] for r in memory if r["remat"] == remat}
        lines.append(f"{remat:<18}" + "".join(f"{row[p]:>22.2f}" for p in PATHS))
    lines += ["", f"gradient collectives per device and step, {args.gpus} x A100-40GB, batch 224, nothing_saveable"]
    for row in collectives:
        for kind in xla_gpu.COLLECTIVES:
            split = ", ".join(f"{dtype} {n / 2**20:.1f} MiB"
                              for dtype, n in sorted(row["bytes_by_dtype"][kind].items()))
            lines.append(f"  {row['grad_reduce_dtype']:<9} {kind:<15} {row['count'][kind]:>5}  {split or '-'}")
    print("\n".join(lines))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step_memory.json").write_text(json.dumps({"memory": memory, "collectives": collectives}, indent=2)
                                              + "\n")


if __name__ == "__main__":
    main()
