"""SigLIP's sigmoid loss against CLIP's softmax loss: per-device memory on 1, 2, 4, 8 devices, and step time.

    python benchmarks/siglip_loss.py [--global-batch 8192] [--per-device-batch 1024] [--embed-dim 768]
                                     [--loss-batch 128] [--model small] [--step-batch 32] [--steps 10]
    python benchmarks/siglip_loss.py --local-step-only --model ViT-B-16 --step-batch 256 --precision bf16  # a GPU

Memory: each loss with its gradient (features, scale, bias) compiled from abstract inputs on the CPU with 8
simulated devices, XLA's memory analysis read per device (temporaries), at a fixed global batch (the sharded
loss's memory should fall with the device count, the sigmoid loss's as the softmax loss's) and at a fixed
per-device batch (the weak-scaling view: every device scores its rows against the global batch either way).
Step time: the whole train step (forward, loss, backward, AdamW) of `--model` on every device (default `small`, a
4-layer ViT at 64 px, where the loss weighs more than in any real model), both losses built in the same run and
taking turns step by step; the ratio of median step times siglip / softmax, and of the two
losses alone (value and gradient, `--loss-batch` per device). With `--local-step-only`, only the train step is
timed, on this machine's own devices (a GPU), under `--precision` with the attention "auto" picks. Writes
OUT/siglip_loss.json (OUT: benchmarks/out).
"""

import argparse
import json
import pathlib
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from train_step import random_batch, time_steps

from clip_jax.models.attention import choose_attention_impl
from clip_jax.models.precision import get_policy
from clip_jax.runtime.mesh import batch_sharding, create_mesh, make_global_batch, replicated
from clip_jax.training.loss import LOSSES
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step, mesh_for

DEVICE_COUNTS = (1, 2, 4, 8)
SMALL = {  # OpenCLIP's model-config format
    "embed_dim": 256,
    "vision_cfg": {"image_size": 64, "layers": 4, "width": 256, "patch_size": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 4},
}


def compiled_loss(loss: str, global_batch: int, embed_dim: int, num_devices: int):
    """value_and_grad of `loss` w.r.t. every input, compiled for `num_devices` devices."""
    mesh = create_mesh(jax.devices()[:num_devices])
    features = jax.ShapeDtypeStruct((global_batch, embed_dim), jnp.float32, sharding=batch_sharding(mesh))
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh))
    inputs = (features, features, scalar) + ((scalar,) if loss == "siglip" else ())
    fn = LOSSES[loss]
    grad = jax.value_and_grad(lambda *a: fn(*a, mesh=mesh)[0], argnums=tuple(range(len(inputs))))
    return jax.jit(grad).lower(*inputs).compile(), inputs


def memory_rows(global_batch: int | None, per_device_batch: int | None, embed_dim: int) -> list[dict]:
    rows = []
    for n in DEVICE_COUNTS:
        batch = global_batch if global_batch else per_device_batch * n
        row = {"devices": n, "global_batch": batch}
        for loss in ("clip", "siglip"):
            row[f"{loss}_temp_bytes"] = compiled_loss(loss, batch, embed_dim, n)[0].memory_analysis().temp_size_in_bytes
        row["siglip_over_clip"] = row["siglip_temp_bytes"] / row["clip_temp_bytes"]
        rows.append(row)
    for row in rows:
        for loss in ("clip", "siglip"):
            row[f"{loss}_vs_one_device"] = row[f"{loss}_temp_bytes"] / rows[0][f"{loss}_temp_bytes"]
    return rows


def time_losses(per_device_batch: int, embed_dim: int, steps: int) -> dict:
    """Median seconds of each loss with its gradient on every device, taking turns."""
    runs = []
    for loss in ("clip", "siglip"):
        compiled, inputs = compiled_loss(loss, per_device_batch * jax.device_count(), embed_dim, jax.device_count())
        rng = np.random.default_rng(0)
        args = [jax.device_put(rng.standard_normal(x.shape).astype(np.float32) / np.sqrt(embed_dim), x.sharding)
                for x in inputs]
        runs.append(lambda compiled=compiled, args=args: jax.block_until_ready(compiled(*args)))
    clip, siglip = (statistics.median(t) for t in time_steps(runs, steps, warmup=2))
    return {"clip_s": clip, "siglip_s": siglip, "ratio": siglip / clip}


def time_train_steps(model: str, per_device_batch: int, steps: int, precision: str = "fp32") -> dict:
    """Median seconds of the whole train step with each loss, on every device, taking turns."""
    runs = []
    attention = choose_attention_impl("auto", jax.devices()[0].platform, get_policy(precision).compute_dtype)
    for loss in ("clip", "siglip"):
        spec = StepSpec.for_model(SMALL if model == "small" else model, precision, attention_impl=attention, loss=loss,
                                  optimizer=OptimizerSpec(lr=1e-4))
        step = build_step(spec, mesh_for(spec))
        batch = make_global_batch(random_batch(spec.model, per_device_batch * jax.device_count()), step.mesh)
        holder = [step.init(seed=0)]

        def run(step=step, batch=batch, holder=holder):
            holder[0], metrics = step(holder[0], batch)
            jax.block_until_ready(metrics)

        runs.append(run)
    clip, siglip = (statistics.median(t) for t in time_steps(runs, steps, warmup=2))
    return {"model": model, "precision": precision, "attention": attention, "per_device_batch": per_device_batch,
            "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind, "clip_s": clip,
            "siglip_s": siglip, "ratio": siglip / clip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch", type=int, default=8192, help="memory at this fixed global batch")
    parser.add_argument("--per-device-batch", type=int, default=1024, help="memory at this batch per device")
    parser.add_argument("--loss-batch", type=int, default=128, help="per-device batch of the timed losses")
    parser.add_argument("--embed-dim", type=int, default=768, help="feature width (ViT-L-14: 768)")
    parser.add_argument("--model", default="small", help="model of the timed train step (a name, .json, small)")
    parser.add_argument("--step-batch", type=int, default=32, help="per-device batch of the timed train step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "pure_bf16"],
                        help="of the timed train step")
    parser.add_argument("--local-step-only", action="store_true",
                        help="time only the train step, on this machine's devices (no simulated CPU devices)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    out = pathlib.Path(args.out) / "siglip_loss.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.local_step_only:
        step_time = time_train_steps(args.model, args.step_batch, args.steps, args.precision)
        print(f"train step, {args.model} {args.precision} ({step_time['attention']} attention), {args.step_batch} per "
              f"device on {jax.device_count()} x {step_time['device_kind']}, median of {args.steps} taking turns: "
              f"softmax {step_time['clip_s'] * 1e3:.1f} ms, sigmoid {step_time['siglip_s'] * 1e3:.1f} ms, ratio "
              f"{step_time['ratio']:.3f}")
        out.write_text(json.dumps({"benchmark": "siglip_loss", "jax": jax.__version__, "step_time": step_time},
                                  indent=2) + "\n")
        print(f"wrote {out}")
        return
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated devices

    print("compiling both losses on 1, 2, 4, 8 devices, then timing", flush=True)
    strong = memory_rows(args.global_batch, None, args.embed_dim)
    weak = memory_rows(None, args.per_device_batch, args.embed_dim)
    loss_time = time_losses(args.loss_batch, args.embed_dim, args.steps)
    step_time = time_train_steps(args.model, args.step_batch, args.steps, args.precision)

    mib = 2**20
    for title, rows in ((f"fixed global batch {args.global_batch}", strong),
                        (f"fixed per-device batch {args.per_device_batch}", weak)):
        print(f"loss + gradient, embed dim {args.embed_dim}, fp32, temp memory per device (XLA:CPU), {title}")
        print(f"{'devices':>8}{'global B':>10}{'softmax':>12}{'vs 1 dev':>10}{'sigmoid':>12}{'vs 1 dev':>10}"
              f"{'sig/soft':>10}")
        for r in rows:
            print(f"{r['devices']:>8}{r['global_batch']:>10}{r['clip_temp_bytes'] / mib:>8.1f} MiB"
                  f"{r['clip_vs_one_device']:>9.3f}x{r['siglip_temp_bytes'] / mib:>8.1f} MiB"
                  f"{r['siglip_vs_one_device']:>9.3f}x{r['siglip_over_clip']:>9.3f}x")
        print()
    print(f"time, median of {args.steps}, both taking turns on {jax.device_count()} CPU devices:")
    print(f"  loss + gradient alone, {args.loss_batch} per device: softmax {loss_time['clip_s'] * 1e3:.1f} ms, "
          f"sigmoid {loss_time['siglip_s'] * 1e3:.1f} ms, ratio {loss_time['ratio']:.3f}")
    print(f"  train step, {args.model}, {args.step_batch} per device: softmax {step_time['clip_s'] * 1e3:.1f} ms, "
          f"sigmoid {step_time['siglip_s'] * 1e3:.1f} ms, ratio {step_time['ratio']:.3f}")

    out.write_text(json.dumps({"benchmark": "siglip_loss", "embed_dim": args.embed_dim, "jax": jax.__version__,
                               "python": platform.python_version(), "fixed_global_batch": strong,
                               "fixed_per_device_batch": weak, "loss_time": loss_time, "step_time": step_time},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
