"""ViT-L/14 at 224 px on one GPU: clip_jax's train step over precisions, remat policies, attention kernels and
per-device batches, and OpenCLIP's own training step on the same GPU with the same model, batch and precision.

    bash benchmarks/gpu_suite.sh                     # on the GPU machine: installs carried wheels, then this
    python benchmarks/gpu_suite.py --out DIR [--phases matmul,core,sweep] [--time-budget 500]
    python benchmarks/gpu_suite.py --out DIR --phases matmul,specs --specs benchmarks/specs/h200_tuning.json
    python benchmarks/gpu_suite.py --tiny --out DIR  # smoke test on the CPU: a tiny model, tiny batches

Every measurement runs in a process of its own (`--one SPEC`), so that JAX and torch never hold the GPU's memory at
the same time and an out-of-memory run does not take the next one with it. The order puts what matters most first,
since the time budget may end the suite early (every run not started is recorded as skipped). Phases run in the
order `--phases` gives:

- matmul: an 8192^3 product per precision through XLA, the measured peak that MFU* is quoted against;
- core (core:bf16, core:fp32: one precision), at the base batch: for each precision and remat policy, clip_jax
  with each attention kernel, then OpenCLIP with the same precision (`amp_bf16` autocast for bf16; TF32 matmuls for
  fp32, as OpenCLIP's `main` sets them) and gradient checkpointing when the policy rematerialises;
- sweep: the fastest bf16 clip_jax setting and the fastest bf16 OpenCLIP setting of the core, at every other batch;
- specs: the runs a JSON file lists (benchmarks/specs/), each with optional extra `xla_flags` for its process:
  "adopted" stands for the XLA:GPU flags the project adopts (clip_jax.runtime.xla_gpu.ADOPTED_FLAGS) and
  "adopted, each off" for one run per adopted flag with the others on and that one off; a run with `"numerics":
  true` also records the loss and gradient norm of its first steps from the same start, so that a flag's runs on
  and off compare its numerics; `grad_reduce_dtype`, `residual_dtype`, `fused_kernels` and `unroll_layers` set the
  StepSpec's fields of those names (a `"fused_kernels": "pallas"` run beside the same run without it times the
  Pallas kernels and compares their numerics; an `"unroll_layers": true` run, the towers' blocks unrolled). Before
  the phase runs, the suite prints what it expects it to take (`--estimate` prints only that): each run at the
  seconds the same run took in earlier leases (benchmarks/results/h200-*.jsonl).

A run: compile (clip_jax) or first step (OpenCLIP), warm-up steps, then `--rounds` rounds of `--steps` steps back to
back; samples/s is the median round's. MFU counts model FLOPs (3x the analytic forward) against the GPU's datasheet peak
for the precision (clip_jax.runtime.hardware), MFU* against the matmul phase's measured peak. clip_jax runs also record
XLA's memory analysis on the GPU and the allocator's peak; bf16 runs with XLA's attention also compile the same step
with the planner on the CPU (`clip_jax.plan`), to compare its estimate.

Writes DIR/gpu_suite.jsonl (one line per run, as each ends), DIR/gpu_suite.txt (the table) and DIR/gpu_env.json.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results"
ADOPTED = "adopted"  # a spec's xla_flags: the XLA:GPU flags the project adopts
EACH_ADOPTED_OFF = "adopted, each off"  # one run per adopted flag: the others on, that one off
# What a lease costs besides its runs, in seconds: the machine's start (a minute or more: two allowed) and
# gpu_suite.sh's set-up (the carried wheels, the import check: 458 s on the device for 429 s of runs, RESULTS 30).
LEASE_START_S = 120.0
SETUP_S = 30.0
GPU_TIME_LIMIT_S = 15 * 60.0  # a lease's device time, all told

# A tiny CLIP for the CPU smoke test (OpenCLIP's model-config format: both frameworks build it).
TINY_MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 32, "heads": 2, "layers": 2},
}


def random_inputs(image_size: int, context_length: int, vocab_size: int, batch: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch, image_size, image_size, 3)).astype(np.float32)  # NHWC
    tokens = rng.integers(1, vocab_size - 1, size=(batch, context_length)).astype(np.int32)
    tokens[:, -1] = vocab_size - 1  # end-of-text, the largest id: where the text tower pools
    return images, tokens


def timed_rounds(run_steps, steps: int, rounds: int, warmup: int) -> list[float]:
    """Seconds per round of `steps` steps (`run_steps(n)` runs n steps and waits for the device)."""
    run_steps(warmup)
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        run_steps(steps)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure_clip_jax(spec: dict) -> dict:
    import jax

    from clip_jax.models import get_model_config
    from clip_jax.models.flops import train_flops
    from clip_jax.models.attention import choose_attention_impl
    from clip_jax.models.precision import get_policy
    from clip_jax.runtime.hardware import gpu_for_device_kind
    from clip_jax.runtime.mesh import create_mesh, make_global_batch
    from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step

    config = get_model_config(spec["model"])
    device = jax.local_devices()[0]
    attention = choose_attention_impl(spec["attention"], device.platform, get_policy(spec["precision"]).compute_dtype)
    mesh = create_mesh([device])
    # a spec may set the precision policy's grad_reduce_dtype / residual_dtype, the fused kernels and the unrolled
    # blocks (StepSpec's defaults otherwise)
    numerics = {k: spec[k] for k in STEP_OPTIONS if k in spec}
    step = build_step(StepSpec(config, spec["precision"], spec["remat"], attention,
                               optimizer=OptimizerSpec(lr=1e-3, warmup=10, total_steps=100_000), **numerics), mesh)
    state = step.init(0)
    images, tokens = random_inputs(config.vision.image_size, config.text.context_length, config.text.vocab_size,
                                   spec["batch"])
    batch = make_global_batch({"images": images, "tokens": tokens}, mesh)

    start = time.perf_counter()
    compiled = step.update.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    metrics = None
    numerics = None
    if spec.get("numerics"):  # from the step's fresh state, before anything else runs
        numerics, state = first_steps(compiled, state, batch)

    def run_steps(n: int) -> None:
        nonlocal state, metrics
        for _ in range(n):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)

    rounds = timed_rounds(run_steps, spec["steps"], spec["rounds"], spec["warmup"])
    samples_per_s = spec["batch"] * spec["steps"] / statistics.median(rounds)
    kernels = None
    if spec.get("profile_dir"):  # after the timed rounds, so the trace costs them nothing
        kernels = profile_kernels(run_steps, compiled, spec)
    gpu = gpu_for_device_kind(device.device_kind)
    flops = train_flops(config)
    stats = device.memory_stats() or {}
    result = {
        "compile_s": compile_s, "round_s": rounds, "samples_per_s": samples_per_s,
        "mfu": samples_per_s * flops / (gpu.peak_tflops(spec["precision"]) * 1e12) if gpu else None,
        "model_flops_per_sample": flops, "loss": float(metrics["loss"]),
        "xla_memory": {"argument": memory.argument_size_in_bytes, "output": memory.output_size_in_bytes,
                       "alias": memory.alias_size_in_bytes, "temp": memory.temp_size_in_bytes},
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
        "device_kind": device.device_kind, "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if kernels is not None:
        result["kernels"] = kernels
    if numerics is not None:
        result["numerics"] = numerics
    m = result["xla_memory"]
    result["xla_memory"]["total"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
    if spec.get("planner_check"):
        del state, compiled
        from clip_jax import plan

        cpu_mesh = create_mesh(jax.devices("cpu")[:1])
        cpu_spec = StepSpec(config, spec["precision"], spec["remat"])  # XLA:CPU: XLA's attention
        estimate = plan.StepMemory.of(plan.compile_train_step(cpu_spec, cpu_mesh, spec["batch"]))
        result["planner_cpu_estimate_bytes"] = estimate.total
    return result


PROFILED_STEPS = 2


def profile_kernels(run_steps, compiled, spec: dict) -> dict:
    """The device's kernels over PROFILED_STEPS steps, from a JAX profiler trace: per kernel name (XLA's fusions
    carry their HLO name; a CUDA graph's kernels share one `hlo_op`, so the name is the finer key), its total time,
    launches per step and the `hlo_op` it ran under. With `spec["keep_raw"]`, the trace and the optimized HLO text
    are also written to `spec["profile_dir"]` (the GPU's own program: autotuned, with Triton GEMMs). A failure here
    never costs the measurement: it is reported instead."""
    import glob
    import gzip
    import shutil
    import tempfile

    import jax

    try:
        trace_dir = tempfile.mkdtemp(prefix="gpu_suite_trace_")
        with jax.profiler.trace(trace_dir):
            run_steps(PROFILED_STEPS)
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
        ops: dict[str, dict] = {}
        planes = list(data.planes)
        devices = [plane for plane in planes if plane.name.startswith("/device:")]
        for plane in devices or planes:  # the CPU smoke test: the host's XLA ops (those with an hlo_op)
            for line in plane.lines:
                for event in line.events:
                    stats = dict(event.stats)
                    if not devices and "hlo_op" not in stats:
                        continue
                    op = ops.setdefault(event.name[:160], {"us": 0.0, "count": 0, "hlo_op": str(stats.get("hlo_op", ""))})
                    op["us"] += event.duration_ns / 1e3 / PROFILED_STEPS
                    op["count"] += 1
        for op in ops.values():
            op["count"] = op["count"] / PROFILED_STEPS
        name = spec["profile_name"]
        if spec.get("keep_raw"):
            out = pathlib.Path(spec["profile_dir"])
            shutil.copy(path, out / f"{name}.xplane.pb")
            with gzip.open(out / f"{name}.hlo.txt.gz", "wt") as f:
                f.write(compiled.as_text())
        shutil.rmtree(trace_dir, ignore_errors=True)
        return {"steps": PROFILED_STEPS, "ops": ops, "device_us_per_step": sum(o["us"] for o in ops.values())}
    except Exception as error:  # noqa: BLE001 -- the profile is a by-product of the measurement
        return {"error": f"{type(error).__name__}: {error}"[:500]}


def measure_open_clip(spec: dict) -> dict:
    import open_clip
    import torch
    from open_clip_step import make_open_clip_step, open_clip_optimizer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # as OpenCLIP's training main sets them
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    if isinstance(spec["model"], dict):
        cfg = spec["model"]
        model = open_clip.CLIP(embed_dim=cfg["embed_dim"], vision_cfg=cfg["vision_cfg"], text_cfg=cfg["text_cfg"])
        image_size, context = cfg["vision_cfg"]["image_size"], cfg["text_cfg"]["context_length"]
        vocab = cfg["text_cfg"]["vocab_size"]
    else:
        model = open_clip.create_model(spec["model"])
        image_size, context, vocab = model.visual.image_size[0], model.context_length, model.vocab_size
    model.to(device).train()
    if spec["remat"] != "none":
        model.set_grad_checkpointing(True)

    optimizer = open_clip_optimizer(model)
    images, tokens = random_inputs(image_size, context, vocab, spec["batch"])
    images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device)  # NCHW
    tokens = torch.from_numpy(tokens).long().to(device)
    one_step = make_open_clip_step(model, optimizer, images, tokens, bf16=spec["precision"] == "bf16")
    last_loss = None

    def run_steps(n: int) -> None:
        nonlocal last_loss
        for _ in range(n):
            last_loss = one_step()
        if cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    run_steps(1)
    first_step_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rounds = timed_rounds(run_steps, spec["steps"], spec["rounds"], spec["warmup"])
    samples_per_s = spec["batch"] * spec["steps"] / statistics.median(rounds)
    result = {"first_step_s": first_step_s, "round_s": rounds, "samples_per_s": samples_per_s,
              "loss": float(last_loss), "torch": torch.__version__, "open_clip": open_clip.__version__,
              "peak_bytes_allocated": torch.cuda.max_memory_allocated() if cuda else None}
    if cuda:
        from clip_jax.models import get_model_config
        from clip_jax.models.flops import train_flops
        from clip_jax.runtime.hardware import gpu_for_device_kind

        gpu = gpu_for_device_kind(torch.cuda.get_device_name())
        flops = train_flops(get_model_config(spec["model"]))
        result["model_flops_per_sample"] = flops
        result["mfu"] = samples_per_s * flops / (gpu.peak_tflops(spec["precision"]) * 1e12) if gpu else None
    return result


def measure_matmul(spec: dict) -> dict:
    """The dense matmul rate this GPU reaches through XLA (an n x n x n product in the precision's dtype; fp32 runs
    at JAX's default precision, TF32 on the GPU): the measured peak that MFU is also reported against."""
    import jax
    import jax.numpy as jnp

    n = spec["batch"]
    dtype = jnp.bfloat16 if spec["precision"] == "bf16" else jnp.float32
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    product = jax.jit(lambda a, b: a @ b)
    out = None

    def run_steps(k: int) -> None:
        nonlocal out
        for _ in range(k):
            out = product(a, b)
        jax.block_until_ready(out)

    rounds = timed_rounds(run_steps, spec["steps"], spec["rounds"], spec["warmup"])
    return {"tflops": 2 * n**3 * spec["steps"] / statistics.median(rounds) / 1e12, "round_s": rounds,
            "device_kind": jax.devices()[0].device_kind}


NUMERICS_STEPS = 5  # a numerics run's first steps, recorded before the timed rounds


def first_steps(compiled, state, batch) -> tuple[dict, object]:
    """The loss and global gradient norm of the first NUMERICS_STEPS steps from `state`, and the state after them."""
    loss, grad_norm = [], []
    for _ in range(NUMERICS_STEPS):
        state, metrics = compiled(state, batch)
        loss.append(float(metrics["loss"]))
        grad_norm.append(float(metrics["grad_norm"]))
    return {"loss": loss, "grad_norm": grad_norm}, state


def measure(spec: dict) -> dict:
    """One run, in this process: the spec and its numbers."""
    if spec["framework"] == "matmul":
        return {**spec, "status": "ok", **measure_matmul(spec)}
    if spec["framework"] == "clip_jax":
        if spec["attention"] == "cudnn":
            import jax

            if jax.devices()[0].platform != "gpu":
                return {**spec, "status": "skipped", "why": "cuDNN attention needs a GPU"}
        numbers = measure_clip_jax(spec)
    else:
        numbers = measure_open_clip(spec)
    return {**spec, "status": "ok", **numbers}


def run_isolated(spec: dict, timeout: float) -> dict:
    """`measure(spec)` in a fresh process; failures (out of memory, timeouts) become a status."""
    command = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(spec)]
    env = dict(os.environ)
    if spec.get("xla_flags"):  # extra XLA flags for this run only
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {spec['xla_flags']}".strip()
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "timeout", "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return {**json.loads(lines[-1]), "seconds": seconds}
    tail = done.stderr[-2000:]
    oom = any(sign in done.stderr for sign in ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemoryError"))
    return {**spec, "status": "oom" if oom else "failed", "seconds": seconds, "stderr_tail": tail}


# StepSpec fields a spec may set
STEP_OPTIONS = ("grad_reduce_dtype", "residual_dtype", "fused_kernels", "unroll_layers")


def adopted_flags() -> dict:
    from clip_jax.runtime.xla_gpu import ADOPTED_FLAGS

    return dict(ADOPTED_FLAGS)


def expand_spec(extra: dict) -> list[dict]:
    """The runs one entry of a specs file stands for, their `xla_flags` as XLA_FLAGS writes them (the module's doc
    says what "adopted" and "adopted, each off" stand for). A boolean flag is switched off by its other value (last in
    XLA_FLAGS, it wins over the same flag set before), any other by leaving it out."""
    from clip_jax.runtime.xla_gpu import xla_flags_text

    adopted = adopted_flags()
    if extra.get("xla_flags") == ADOPTED:
        return [{**extra, "xla_flags": xla_flags_text(adopted)}]
    if extra.get("xla_flags") == EACH_ADOPTED_OFF:
        runs = []
        for name, value in adopted.items():
            others = {other: v for other, v in adopted.items() if other != name}
            flags = {**others, name: not value} if isinstance(value, bool) else others
            runs.append({**extra, "xla_flags": xla_flags_text(flags), "flag_off": name})
        return runs
    return [extra]


def recorded_runs(results: pathlib.Path = RESULTS) -> list[dict]:
    """Every finished run earlier leases recorded, with its seconds (compile or first step, warm-up, rounds)."""
    runs = [json.loads(line) for path in sorted(results.glob("h200-*.jsonl")) for line in path.read_text().splitlines()]
    return [r for r in runs if r.get("status") == "ok" and r.get("seconds")]


def estimated_seconds(spec: dict, recorded: list[dict]) -> float:
    """What a run will take: the mean seconds of the same run in earlier leases (framework, precision, remat, batch,
    attention; XLA flags and numerics aside), else of the framework's runs at that batch, else its longest run."""
    def same(run: dict, keys: tuple) -> bool:
        return all(run.get(key, "-") == spec.get(key, "-") for key in keys)

    for keys in (("framework", "precision", "remat", "batch", "attention"), ("framework", "batch")):
        seconds = [run["seconds"] for run in recorded if same(run, keys)]
        if seconds:
            return statistics.mean(seconds)
    return max(run["seconds"] for run in recorded if run["framework"] == spec["framework"])


def estimate_lines(runs: list[dict], recorded: list[dict]) -> tuple[list[str], float]:
    """The table of what each run is expected to take, and the lease's expected device time, all told."""
    lines = [f"expected GPU time (each run at its earlier leases' seconds, {len(recorded)} recorded runs):"]
    total = LEASE_START_S + SETUP_S
    for spec in runs:
        seconds = estimated_seconds(spec, recorded)
        total += seconds
        flags = f" xla_flags={spec['xla_flags']}" if spec.get("xla_flags") else ""
        options = "".join(f" {k}={spec[k]}" for k in STEP_OPTIONS if k in spec)
        lines.append(f"  {seconds:6.0f} s  {spec['framework']} {spec['precision']} remat={spec['remat']} "
                     f"attn={spec.get('attention', '-')} batch={spec['batch']}{options}{flags}")
    lines.append(f"  {LEASE_START_S + SETUP_S:6.0f} s  the machine's start and the suite's set-up")
    lines.append(f"  {total:6.0f} s  in all ({total / 60:.1f} of the lease's {GPU_TIME_LIMIT_S / 60:.0f} minutes)")
    return lines, total


def spec_for(args, framework: str, precision: str, remat: str, batch: int, attention: str = "-",
             planner_check: bool = False) -> dict:
    return {"framework": framework, "model": TINY_MODEL if args.tiny else args.model, "precision": precision,
            "remat": remat, "attention": attention, "batch": batch, "steps": args.steps, "rounds": args.rounds,
            "warmup": args.warmup, "planner_check": planner_check}


def core_specs(args, precisions: list[str]) -> list[dict]:
    """Per precision and remat policy: clip_jax with each attention kernel, then OpenCLIP (once per checkpointing)."""
    specs, open_clip_done = [], set()
    for precision in precisions:
        for remat in args.remats:
            for attention in args.attentions:
                if attention == "cudnn" and precision == "fp32":
                    continue  # cuDNN's fused attention takes fp16/bf16 only
                # The planner compiles XLA's attention on the CPU: compare it with the GPU's run of the same.
                check = args.planner_check and precision == "bf16" and attention == "xla"
                specs.append(spec_for(args, "clip_jax", precision, remat, args.base_batch, attention, check))
            checkpointing = "none" if remat == "none" else "grad_checkpointing"
            if (precision, checkpointing) not in open_clip_done:
                open_clip_done.add((precision, checkpointing))
                specs.append(spec_for(args, "open_clip", precision, remat, args.base_batch))
    return specs


def best(results: list[dict], framework: str) -> dict | None:
    ok = [r for r in results if r["framework"] == framework and r["status"] == "ok" and r["precision"] == "bf16"]
    return max(ok, key=lambda r: r["samples_per_s"]) if ok else None


def format_table(results: list[dict]) -> str:
    measured_peak = {r["precision"]: r["tflops"] for r in results if r["framework"] == "matmul" and r["status"] == "ok"}
    lines = [f"matmul {r['precision']} {r['batch']}^3: "
             + (f"{r['tflops']:.4g} TFLOP/s (measured peak)" if r["status"] == "ok" else r["status"])
             for r in results if r["framework"] == "matmul"]
    lines.append(f"{'framework':<10}{'prec':<6}{'remat':<18}{'attn':<7}{'batch':>6}{'status':>9}{'samples/s':>11}"
                 f"{'MFU':>7}{'MFU*':>7}{'compile s':>10}{'GPU GiB':>9}{'plan GiB':>9}")
    for r in results:
        if r["framework"] == "matmul":
            continue
        ok = r["status"] == "ok"
        rate = f"{r['samples_per_s']:.1f}" if ok else "-"
        mfu = f"{r['mfu']:.1%}" if ok and r.get("mfu") is not None else "-"
        flops = r.get("model_flops_per_sample")
        mfu_measured = (f"{r['samples_per_s'] * flops / (measured_peak[r['precision']] * 1e12):.1%}"
                        if ok and flops and r["precision"] in measured_peak else "-")
        compile_s = f"{r['compile_s']:.1f}" if ok and "compile_s" in r else "-"
        peak = r.get("peak_bytes_in_use") or r.get("peak_bytes_allocated")
        peak = f"{peak / 2**30:.1f}" if ok and peak else "-"
        planned = r.get("planner_cpu_estimate_bytes")
        planned = f"{planned / 2**30:.1f}" if planned else "-"
        lines.append(f"{r['framework']:<10}{r['precision']:<6}{r['remat']:<18}{r['attention']:<7}{r['batch']:>6}"
                     f"{r['status']:>9}{rate:>11}{mfu:>7}{mfu_measured:>7}{compile_s:>10}{peak:>9}{planned:>9}"
                     + (f"  {r['xla_flags']}" if r.get("xla_flags") else "")
                     + "".join(f"  {k}={r[k]}" for k in STEP_OPTIONS if k in r))
    lines.append("MFU: model FLOPs (3x forward) over the datasheet's dense peak; "
                 "MFU*: over the matmul peak measured above")
    pairs = [(r, o) for r in results for o in results
             if r["framework"] == "clip_jax" and o["framework"] == "open_clip" and r["status"] == o["status"] == "ok"
             and r["precision"] == o["precision"] and r["batch"] == o["batch"]
             and (r["remat"] == "none") == (o["remat"] == "none")]
    if pairs:
        lines.append("")
        lines.append("clip_jax / OpenCLIP samples/s, same precision, batch and checkpointing (best clip_jax setting):")
        keyed = {}
        for ours, theirs in pairs:
            key = (ours["precision"], ours["batch"], ours["remat"] == "none")
            if key not in keyed or ours["samples_per_s"] > keyed[key][0]["samples_per_s"]:
                keyed[key] = (ours, theirs)
        for (precision, batch, no_remat), (ours, theirs) in sorted(keyed.items()):
            lines.append(f"  {precision} batch {batch} {'no remat' if no_remat else 'remat'}: "
                         f"{ours['samples_per_s'] / theirs['samples_per_s']:.2f}x "
                         f"({ours['remat']}, {ours['attention']})")
    return "\n".join(lines + numerics_lines(results))


def numerics_lines(results: list[dict]) -> list[str]:
    """Each adopted flag switched off against the run with every adopted flag on, same setting: how far its first
    steps' losses and gradient norms move (both runs start from the same state and batch), and its speed."""
    setting = ("framework", "precision", "remat", "attention", "batch")
    lines = []
    for off in (r for r in results if r.get("flag_off") and "numerics" in r):
        on = next((r for r in results if "numerics" in r and not r.get("flag_off")
                   and all(r[k] == off[k] for k in setting)), None)
        if on is None:
            continue
        moved = {name: max(abs(a - b) / abs(b) for a, b in zip(off["numerics"][name], on["numerics"][name]))
                 for name in ("loss", "grad_norm")}
        lines.append(f"  {off['flag_off']} ({off['precision']} {off['remat']} {off['batch']}): off against on, first "
                     f"{len(on['numerics']['loss'])} steps: loss within {moved['loss']:.1e}, gradient norm within "
                     f"{moved['grad_norm']:.1e} (relative); {on['samples_per_s'] / off['samples_per_s']:.3f}x "
                     "the samples/s on")
    return ["", "adopted XLA flags' numerics:", *lines] if lines else []


def environment() -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")}
    try:
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           check=False, timeout=30).stdout.strip()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        env["nvidia_smi"] = None
    return env


def sweep(args, results: list[dict], run) -> None:
    """The fastest bf16 setting of each framework so far, at every other batch."""
    ours, theirs = best(results, "clip_jax"), best(results, "open_clip")
    if ours is None:  # the core did not run or nothing succeeded: sweep the first configured setting
        ours = spec_for(args, "clip_jax", "bf16", args.remats[0], args.base_batch, args.attentions[0])
    if theirs is None:
        theirs = spec_for(args, "open_clip", "bf16", args.remats[0], args.base_batch)
    for batch in (int(b) for b in args.batches.split(",")):
        for chosen in (ours, theirs):
            run(spec_for(args, chosen["framework"], chosen["precision"], chosen["remat"], batch,
                         chosen["attention"]))


def planned_runs(args, phase: str, out: pathlib.Path) -> list[dict]:
    """The runs of the matmul and specs phases, known before any runs (the others depend on earlier results)."""
    if phase == "matmul":
        return [{**spec_for(args, "matmul", precision, "-", 1024 if args.tiny else 8192), "steps": 10}
                for precision in args.precisions]
    if phase != "specs":
        return []
    runs = []
    for extra in (run for entry in json.loads(pathlib.Path(args.specs).read_text()) for run in expand_spec(entry)):
        spec = {**spec_for(args, extra["framework"], extra["precision"], extra["remat"], extra["batch"],
                           extra.get("attention", "-")), **extra}
        if args.profile and spec["framework"] == "clip_jax":  # the first run's raw trace and HLO come back
            spec.update(profile_dir=str(out.resolve()), profile_name=f"spec{len(runs)}", keep_raw=not runs)
        runs.append(spec)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one", help="run one spec (JSON) in this process and print its result")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    parser.add_argument("--model", default="ViT-L-14")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model and tiny batches")
    parser.add_argument("--phases", default="matmul,core,sweep",
                        help="run in this order: matmul (the measured peak), core (every precision), "
                             "core:PRECISION (one), sweep, specs (the runs listed in --specs)")
    parser.add_argument("--specs", help="JSON file: a list of runs ({framework, precision, remat, batch, attention, "
                                        "xla_flags?, numerics?}) for the specs phase")
    parser.add_argument("--estimate", action="store_true",
                        help="print the GPU time the matmul and specs phases are expected to take, run nothing")
    parser.add_argument("--precisions", default="bf16,fp32")
    parser.add_argument("--remats", default="none,nothing_saveable,dots_saveable")
    parser.add_argument("--attentions", default="cudnn,xla")
    parser.add_argument("--base-batch", type=int, default=256)
    parser.add_argument("--batches", default="64,128,384,512", help="the sweep's other per-device batches")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=500.0, help="seconds; later runs are skipped")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds for one run")
    parser.add_argument("--no-planner-check", dest="planner_check", action="store_false")
    parser.add_argument("--profile", action="store_true",
                        help="specs phase: each clip_jax run also traces %d steps and records its kernels' times "
                             "(the first run's trace and optimized HLO are written to --out)" % PROFILED_STEPS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))), flush=True)
        return
    if args.tiny:
        args.base_batch, args.batches = 4, "2,8"
        args.steps, args.rounds, args.warmup = 2, 2, 1
    args.precisions, args.remats = args.precisions.split(","), args.remats.split(",")
    args.attentions = args.attentions.split(",")
    phases = args.phases.split(",")
    out = pathlib.Path(args.out)
    if args.estimate or "specs" in phases:
        planned = [spec for phase in phases for spec in planned_runs(args, phase, out)]
        lines, _ = estimate_lines(planned, recorded_runs())
        print("\n".join(lines), flush=True)
        if args.estimate:
            if any(phase.startswith(("core", "sweep")) for phase in phases):
                print("(the core and sweep phases are not estimated)")
            return

    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_env.json").write_text(json.dumps(environment(), indent=2) + "\n")
    results_file = out / "gpu_suite.jsonl"
    results_file.write_text("")
    deadline = time.monotonic() + args.time_budget
    results = []

    def run(spec: dict) -> None:
        left = deadline - time.monotonic()
        if left < 10:
            result = {**spec, "status": "skipped", "why": "time budget"}
        else:
            result = run_isolated(spec, min(left, args.run_timeout))
        results.append(result)
        with results_file.open("a") as f:
            f.write(json.dumps(result) + "\n")
        rate = result["status"]
        if result["status"] == "ok":
            rate = (f"{result['tflops']:.0f} TFLOP/s" if spec["framework"] == "matmul"
                    else f"{result['samples_per_s']:.1f} samples/s")
        flags = f" xla_flags={spec['xla_flags']}" if spec.get("xla_flags") else ""
        print(f"{spec['framework']} {spec['precision']} remat={spec['remat']} attn={spec['attention']} "
              f"batch={spec['batch']}{flags}: {rate}", flush=True)

    for phase in phases:
        if phase in ("specs", "matmul"):
            for spec in planned_runs(args, phase, out):
                run(spec)
        elif phase == "core" or phase.startswith("core:"):
            for spec in core_specs(args, args.precisions if phase == "core" else [phase.split(":", 1)[1]]):
                run(spec)
        elif phase == "sweep":
            sweep(args, results, run)
        else:
            parser.error(f"unknown phase {phase!r}: core, core:PRECISION or sweep")
    table = format_table(results)
    (out / "gpu_suite.txt").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
