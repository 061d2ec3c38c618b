"""Train-step throughput: clip_jax's jitted step against OpenCLIP's own fp32 step on the same model and batch.

    python benchmarks/train_step.py --model ViT-B-32 --batch 8 [--precision fp32] [--remat none] [--steps 5]
    python benchmarks/train_step.py --model ViT-L-14 --batch 2 --sequential

Times the whole step (forward, contrastive loss, backward, AdamW with OpenCLIP's decay groups, logit-scale
clamp) on random images and tokens, on every local device (global batch split over them). Reports compile
time, median and best step time and samples/s; on GPU also MFU from the analytic model FLOPs (3x the forward;
recomputation by remat is not counted). On CPU, OpenCLIP's fp32 step (torch, AdamW, `ClipLoss`, gradient
checkpointing when remat is on) runs in the same process, the two taking turns step by step so that other
load on the machine hits both alike (`--sequential`: one after the other, for models too big to hold twice),
and the ratios are printed. Writes benchmarks/out/train_step-MODEL-bBATCH-PRECISION-REMAT.json.
"""

import argparse
import ctypes
import gc
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import numpy as np
from open_clip_step import make_open_clip_step, open_clip_optimizer

from clip_jax.models import get_model_config
from clip_jax.models.flops import train_flops
from clip_jax.models.attention import choose_attention_impl
from clip_jax.models.precision import get_policy
from clip_jax.runtime.hardware import gpu_for_device_kind
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step


def keep_freed_memory_mapped() -> None:
    """Make glibc keep freed memory instead of unmapping it (one arena, no mmap, no trimming).

    By default every buffer over 32 MB is mmap'ed and unmapped again when freed, so each step page-faults its
    whole temporary memory anew (about a quarter of a second per GB here). Both frameworks allocate through
    glibc, so both run with this setting.
    """
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    for option, value in ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, 2**31 - 1)):
        if libc.mallopt(option, value) != 1:
            raise RuntimeError(f"mallopt({option}, {value}) failed")


def random_batch(config, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    size, context = config.vision.image_size, config.text.context_length
    tokens = rng.integers(1, config.text.vocab_size - 1, size=(batch_size, context))
    tokens[:, -1] = config.text.vocab_size - 1  # end-of-text: the largest id, where the text tower pools
    return {
        "images": rng.normal(size=(batch_size, size, size, 3)).astype(np.float32),
        "tokens": tokens.astype(np.int32),
    }


def time_steps(run_steps, steps: int, warmup: int) -> list[list[float]]:
    """Seconds per step of each function; they take turns step by step, so load changes hit all alike."""
    for run_step in run_steps:
        for _ in range(warmup):
            run_step()
    times = [[] for _ in run_steps]
    for _ in range(steps):
        for run_step, seconds in zip(run_steps, times, strict=True):
            start = time.perf_counter()
            run_step()
            seconds.append(time.perf_counter() - start)
    return times


def compiled_runner(step, state, global_batch) -> tuple:
    """(run_step, compiled, compile_s): `step`'s update compiled for `global_batch`, and a closure that runs one
    step on the state it carries (the old state is donated) and waits for its metrics."""
    start = time.perf_counter()
    compiled = step.update.lower(state, global_batch).compile()
    compile_s = time.perf_counter() - start

    def run_step():
        nonlocal state
        state, metrics = compiled(state, global_batch)
        jax.block_until_ready(metrics)

    return run_step, compiled, compile_s


def clip_jax_step(args, config, batch) -> dict:
    mesh = create_mesh(jax.local_devices())
    attention = choose_attention_impl("auto", mesh.devices.flat[0].platform, get_policy(args.precision).compute_dtype)
    spec = StepSpec(config, args.precision, args.remat, attention, fsdp=args.fsdp, accum_steps=args.accum_steps,
                    optimizer=OptimizerSpec(lr=1e-3, warmup=10, total_steps=10_000))
    step = build_step(spec, mesh)

    start = time.perf_counter()
    state = step.init(0)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - start

    run_step, compiled, compile_s = compiled_runner(step, state, make_global_batch(batch, mesh))
    memory = compiled.memory_analysis()

    return run_step, {
        "init_s": init_s,
        "compile_s": compile_s,
        "temp_bytes_per_device": memory.temp_size_in_bytes if memory else None,
        "argument_bytes_per_device": memory.argument_size_in_bytes if memory else None,
    }


def open_clip_step(args, batch) -> dict:
    """OpenCLIP's training step in fp32, as its train_one_epoch does it without AMP."""
    import open_clip
    import torch

    torch.manual_seed(0)
    model = open_clip.create_model(args.model)
    model.train()
    if args.remat != "none":
        model.set_grad_checkpointing(True)
    images = torch.from_numpy(batch["images"]).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    tokens = torch.from_numpy(batch["tokens"]).long()
    step = make_open_clip_step(model, open_clip_optimizer(model), images, tokens)
    return step, {
        "torch": torch.__version__,
        "open_clip": open_clip.__version__,
        "torch_threads": torch.get_num_threads(),
    }


# XLA:CPU thunk names -> what they do. Matmuls run as "ynn_fusion" (YNNPACK) or "dot"; the scanned layer stacks
# show up as dynamic slices (one layer's weights out of the stack) and dynamic-update-slices (its gradient back in).
OP_KINDS = (
    ("matmul", ("ynn_fusion", "dot", "convolution")),
    ("layer slice / gradient write-back", ("dynamic-slice", "dynamic-update-slice")),
    ("broadcast (zero fills)", ("broadcast",)),
    ("copy / transpose", ("copy", "transpose")),
)


def profile_breakdown(run_step, steps: int = 2) -> dict[str, float]:
    """Seconds per step by kind of XLA operation, from a profiler trace (thread time summed over threads, so
    the kinds add up to more than the wall time when ops run side by side)."""
    import collections
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            run_step()
        jax.profiler.stop_trace()
        (path,) = pathlib.Path(trace_dir).rglob("*.xplane.pb")
        profile = ProfileData.from_file(str(path))
    seconds = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if event.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "while")):
                    continue  # containers of the ops below, and waiting
                kind = next((k for k, names in OP_KINDS if any(n in event.name for n in names)), "other")
                seconds[kind] += event.duration_ns / 1e9 / steps
    return dict(seconds.most_common())


def report(args, config, device, ours: dict, theirs: dict | None) -> dict:
    """Print the table; return the JSON record. Medians, and best steps, which other load on the machine
    disturbs least."""
    train_flops_per_sample = train_flops(config)
    step_s = statistics.median(ours["step_times_s"])
    samples_per_s = args.batch / step_s
    gpu = gpu_for_device_kind(device.device_kind) if device.platform == "gpu" else None
    peak = gpu.peak_tflops(args.precision) * 1e12 if gpu else None
    mfu = train_flops_per_sample * samples_per_s / (peak * jax.device_count()) if peak else None

    setting = f"{args.model} b={args.batch} {args.precision} remat={args.remat} accum={args.accum_steps}"
    print(f"train step, {setting}, fsdp={args.fsdp}, {jax.device_count()} x {device.device_kind}")
    print(
        f"compile {ours['compile_s']:.1f} s, init {ours['init_s']:.1f} s, "
        f"{train_flops_per_sample / 1e9:.1f} GFLOP/sample (3x forward)"
    )
    print(f"{'':<12}{'median s':>10}{'best s':>10}{'samples/s':>12}{'MFU':>8}")
    print(
        f"{'clip_jax':<12}{step_s:>10.3f}{min(ours['step_times_s']):>10.3f}{samples_per_s:>12.2f}"
        f"{(f'{mfu:.1%}' if mfu else '-'):>8}"
    )
    result = {
        "benchmark": "train_step",
        "model": args.model,
        "global_batch": args.batch,
        "precision": args.precision,
        "remat": args.remat,
        "accum_steps": args.accum_steps,
        "fsdp": args.fsdp,
        "devices": jax.device_count(),
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "system_malloc": args.system_malloc,
        "model_flops_per_sample": train_flops_per_sample,
        "clip_jax": {**ours, "step_s": step_s, "samples_per_s": samples_per_s, "mfu": mfu},
    }
    if theirs:
        their_step_s = statistics.median(theirs["step_times_s"])
        ratio, best_ratio = their_step_s / step_s, min(theirs["step_times_s"]) / min(ours["step_times_s"])
        print(
            f"{'open_clip':<12}{their_step_s:>10.3f}{min(theirs['step_times_s']):>10.3f}"
            f"{args.batch / their_step_s:>12.2f}{'-':>8}"
        )
        print(f"clip_jax / open_clip samples/s: {ratio:.2f}x (medians), {best_ratio:.2f}x (best steps)")
        result["open_clip"] = {**theirs, "step_s": their_step_s, "samples_per_s": args.batch / their_step_s}
        result.update(ratio=ratio, best_step_ratio=best_ratio)
    if "profile_s_per_step" in ours:
        total = sum(ours["profile_s_per_step"].values())
        print(f"clip_jax's step by XLA operation, thread-seconds per step ({total:.2f} in all):")
        for kind, seconds in ours["profile_s_per_step"].items():
            print(f"  {kind:<36}{seconds:>8.3f}{seconds / total:>6.0%}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=8, help="global batch size")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "pure_bf16"])
    parser.add_argument("--remat", default="none", help='"none" or a jax.checkpoint_policies name')
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after compilation")
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (default: keep freed memory, see keep_freed_memory_mapped)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="time clip_jax, free it, then OpenCLIP (less memory; default: steps take turns)",
    )
    parser.add_argument(
        "--baseline",
        choices=["auto", "open_clip", "none"],
        default="auto",
        help="auto: OpenCLIP's step on CPU only",
    )
    parser.add_argument("--profile", action="store_true", help="also print where clip_jax's step spends its time")
    args = parser.parse_args()
    if not args.system_malloc:
        keep_freed_memory_mapped()

    load_at_start = os.getloadavg()[0]
    config = get_model_config(args.model)
    device = jax.local_devices()[0]
    batch = random_batch(config, args.batch)
    run_baseline = args.baseline == "open_clip" or (args.baseline == "auto" and device.platform == "cpu")
    if run_baseline and args.precision != "fp32":
        raise SystemExit("the OpenCLIP baseline runs in fp32: use --precision fp32 or --baseline none")
    our_step, ours = clip_jax_step(args, config, batch)
    if args.profile:
        ours["profile_s_per_step"] = profile_breakdown(our_step)
    if not run_baseline:
        (ours["step_times_s"],) = time_steps([our_step], args.steps, args.warmup)
        theirs = None
    elif args.sequential:  # one after the other: only one model in memory at a time
        (ours["step_times_s"],) = time_steps([our_step], args.steps, args.warmup)
        del our_step
        gc.collect()
        their_step, theirs = open_clip_step(args, batch)
        (theirs["step_times_s"],) = time_steps([their_step], args.steps, args.warmup)
    else:
        their_step, theirs = open_clip_step(args, batch)
        ours["step_times_s"], theirs["step_times_s"] = time_steps(
            [our_step, their_step], args.steps, args.warmup
        )

    result = report(args, config, device, ours, theirs)
    result["load_average_1min"] = {"start": load_at_start, "end": os.getloadavg()[0]}
    out = (
        pathlib.Path(__file__).parent
        / "out"
        # a model given as a config file is named by its file name: no path separators in the output name
        / (f"train_step-{pathlib.Path(args.model).stem}-b{args.batch}-{args.precision}-{args.remat}.json")
    )
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
