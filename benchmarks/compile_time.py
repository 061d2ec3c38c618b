"""Compile time of the ViT-L/14 train step against depth: flat, because each tower's blocks are one scanned loop.

    python benchmarks/compile_time.py [--depths 6,12,24] [--batch 8] [--precision fp32] [--remat nothing_saveable]
    python benchmarks/compile_time.py --open-clip        # also OpenCLIP's model under torch.compile (minutes)

For each depth the image tower has that many blocks and the text tower half as many (ViT-L/14 is 24 + 12); widths,
heads and everything else stay ViT-L/14's. clip_jax's whole train step (forward, sharded contrastive loss, backward,
AdamW) is lowered and compiled for one CPU device from abstract inputs, `--repeats` times (caches cleared; the
fastest counts, wall and CPU seconds, since other load on the machine only adds); the size of the optimized HLO is
recorded too. With `--open-clip`, OpenCLIP's own model of the same depths runs training steps (forward, `ClipLoss`,
backward; fp32, gradient checkpointing when remat is on) under `torch.compile` (what its `--torchcompile` flag
does), and the compile time is the first step's time minus a later step's. Writes benchmarks/out/compile_time.json.
"""

import argparse
import dataclasses
import json
import pathlib
import platform
import time

import jax

from clip_jax.models import get_model_config
from clip_jax.plan import compile_train_step
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.step_factory import StepSpec

BASE = "ViT-L-14"


def at_depth(depth: int):
    config = get_model_config(BASE)
    return dataclasses.replace(
        config, name=f"{BASE}-depth{depth}",
        vision=dataclasses.replace(config.vision, layers=depth),
        text=dataclasses.replace(config.text, layers=max(1, depth // 2)),
    )


def clip_jax_compile(config, args) -> dict:
    setup = StepSpec(config, args.precision, args.remat)
    mesh = create_mesh(jax.devices()[:1])
    wall, cpu = [], []
    for _ in range(args.repeats):
        jax.clear_caches()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        compiled = compile_train_step(setup, mesh, args.batch)
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return {"compile_s": min(wall), "compile_cpu_s": min(cpu), "wall_s": wall,
            "hlo_lines": compiled.as_text().count("\n")}


def open_clip_compile(config, args) -> dict:
    """OpenCLIP's model at this depth under torch.compile: first training step minus a later one."""
    import open_clip
    import torch
    import torch._inductor.config
    from open_clip.loss import ClipLoss

    torch._inductor.config.force_disable_caches = True  # compile anew, as a first run does
    torch.manual_seed(0)
    v, t = config.vision, config.text
    model = open_clip.CLIP(
        embed_dim=config.embed_dim,
        vision_cfg={"image_size": v.image_size, "layers": v.layers, "width": v.width, "patch_size": v.patch_size},
        text_cfg={"context_length": t.context_length, "vocab_size": t.vocab_size, "width": t.width,
                  "heads": t.heads, "layers": t.layers},
    )
    if args.remat != "none":
        model.set_grad_checkpointing(True)
    compiled = torch.compile(model)
    loss_fn = ClipLoss()
    images = torch.randn(args.batch, 3, v.image_size, v.image_size)
    tokens = torch.randint(1, t.vocab_size - 1, (args.batch, t.context_length))
    tokens[:, -1] = t.vocab_size - 1

    def step() -> float:
        start = time.perf_counter()
        loss = loss_fn(*compiled(images, tokens))
        loss.backward()
        return time.perf_counter() - start

    first = step()
    later = min(step() for _ in range(2))
    torch._dynamo.reset()
    return {"compile_s": first - later, "first_step_s": first, "step_s": later, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", default="6,12,24", help="image-tower depths (text tower: half)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "pure_bf16"])
    parser.add_argument("--repeats", type=int, default=2, help="compiles per depth (the fastest counts)")
    parser.add_argument("--remat", default="nothing_saveable", help='"none" or a jax.checkpoint_policies name')
    parser.add_argument("--open-clip", action="store_true", help="also time torch.compile of OpenCLIP's model")
    args = parser.parse_args()

    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        config = at_depth(depth)
        row = {"image_layers": config.vision.layers, "text_layers": config.text.layers,
               "clip_jax": clip_jax_compile(config, args)}
        if args.open_clip:
            row["open_clip_torch_compile"] = open_clip_compile(config, args)
        rows.append(row)
        print(f"depth {depth}: {row}", flush=True)

    print(f"\n{BASE} train step compile time, batch {args.batch}, {args.precision}, remat {args.remat}, "
          f"1 x {jax.devices()[0].device_kind}")
    header = f"{'image+text blocks':<20}{'clip_jax s':>12}{'cpu s':>8}{'HLO lines':>11}"
    if args.open_clip:
        header += f"{'torch.compile s':>17}"
    print(header)
    base = rows[0]["clip_jax"]["compile_s"]
    for row in rows:
        line = (f"{row['image_layers']:>3} + {row['text_layers']:<14}{row['clip_jax']['compile_s']:>12.1f}"
                f"{row['clip_jax']['compile_cpu_s']:>8.1f}{row['clip_jax']['hlo_lines']:>11}")
        if args.open_clip:
            line += f"{row['open_clip_torch_compile']['compile_s']:>17.1f}"
        print(line)
    deepest = rows[-1]["clip_jax"]["compile_s"]
    print(f"clip_jax: {rows[-1]['image_layers'] / rows[0]['image_layers']:.0f}x the depth, "
          f"{deepest / base:.2f}x the compile time")
    if args.open_clip:
        theirs = [row["open_clip_torch_compile"]["compile_s"] for row in rows]
        print(f"OpenCLIP under torch.compile: {theirs[-1] / theirs[0]:.2f}x the compile time")

    out = pathlib.Path(__file__).parent / "out" / "compile_time.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "compile_time", "model": BASE, "batch": args.batch, "precision": args.precision,
        "remat": args.remat, "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
        "python": platform.python_version(), "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
