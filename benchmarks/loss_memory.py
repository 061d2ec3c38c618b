"""Per-device memory of the sharded contrastive loss (and its gradient) at growing global batch, 8 devices vs 1.

    python benchmarks/loss_memory.py [--batches 1024,4096,16384,65536,86016] [--embed-dim 768]

Each device scores its own rows against every column: two [B_local, B_global] float32 logit blocks, so the
per-device memory of the loss should fall 8x from 1 device to 8 at the same global batch (OpenCLIP's default
`ClipLoss` holds the full [B, B] on every GPU; its `--local-loss --gather-with-grad` does what we do). The loss and
its gradient with respect to both feature sets and the scale are compiled from abstract inputs (nothing is
allocated) on the CPU with 8 simulated devices, and XLA's memory analysis is read per device. The table also gives
the size of the logits alone: our two [B_local, B_global] blocks on 8 devices, and, for comparison (computed, not
measured), the one [B, B] block OpenCLIP's default `ClipLoss` holds on every GPU whatever their number (its
logits_per_text is a transposed view). Writes benchmarks/out/loss_memory.json.
"""

import argparse
import json
import pathlib
import platform

import jax
import jax.numpy as jnp

from clip_jax.runtime.mesh import batch_sharding, create_mesh, replicated
from clip_jax.training.loss import contrastive_loss


def loss_memory(global_batch: int, embed_dim: int, num_devices: int) -> dict:
    """XLA's per-device memory analysis of value_and_grad of the loss on `num_devices` devices."""
    mesh = create_mesh(jax.devices()[:num_devices])
    features = jax.ShapeDtypeStruct((global_batch, embed_dim), jnp.float32, sharding=batch_sharding(mesh))
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh))
    loss = jax.value_and_grad(lambda i, t, s: contrastive_loss(i, t, s, mesh=mesh), argnums=(0, 1, 2))
    memory = jax.jit(loss).lower(features, features, scale).compile().memory_analysis()
    local = global_batch // num_devices
    return {"temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
            "logits_bytes": 2 * local * global_batch * 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1024,4096,16384,65536,86016", help="global batch sizes")
    parser.add_argument("--embed-dim", type=int, default=768, help="feature width (ViT-L-14: 768)")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated devices

    rows = []
    for global_batch in (int(b) for b in args.batches.split(",")):
        one, eight = loss_memory(global_batch, args.embed_dim, 1), loss_memory(global_batch, args.embed_dim, 8)
        rows.append({"global_batch": global_batch, "one_device": one, "eight_devices": eight,
                     "temp_ratio": one["temp_bytes"] / eight["temp_bytes"],
                     "open_clip_default_logits_bytes": global_batch**2 * 4})

    gib = 2**30
    print(f"sharded contrastive loss + gradient, embed dim {args.embed_dim}, float32, per-device memory "
          f"(XLA:CPU memory analysis)")
    print(f"{'global batch':>13}{'1 dev temp':>13}{'8 dev temp':>13}{'ratio':>8}{'8 dev logits':>14}"
          f"{'OpenCLIP [B,B]':>16}")
    for row in rows:
        print(f"{row['global_batch']:>13,}{row['one_device']['temp_bytes'] / gib:>9.3f} GiB"
              f"{row['eight_devices']['temp_bytes'] / gib:>9.3f} GiB{row['temp_ratio']:>7.2f}x"
              f"{row['eight_devices']['logits_bytes'] / gib:>10.3f} GiB"
              f"{row['open_clip_default_logits_bytes'] / gib:>12.3f} GiB")
    out = pathlib.Path(__file__).parent / "out" / "loss_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"benchmark": "loss_memory", "embed_dim": args.embed_dim, "jax": jax.__version__,
                               "python": platform.python_version(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
