"""A `Plan` for people (`format_plan`: the report `python -m clip_jax.plan` prints) and for machines (`plan_json`:
`--json`, every field of the plan under its own name)."""

import dataclasses
import json

from clip_jax.plan.result import Plan, PredictedStep


def size(n: float) -> str:
    """Bytes in GiB, or in MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _gflop(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def plan_json(p: Plan) -> str:
    return json.dumps(dataclasses.asdict(p), indent=2)


def _memory_lines(p: Plan) -> list[str]:
    s, m = p.setup, p.memory_per_device
    lines = [
        f"memory per device ({m.measured_by})",
        f"  train state       {size(m.state_bytes):>11}   params + AdamW moments (from the tree and its sharding)",
        (f"  batch             {size(m.batch_bytes):>11}   float32 "
         + (f"NaFlex rows ({s.max_num_patches} patches an image)" if s.max_num_patches else "images")
         + " + int32 tokens"),
        f"  temporaries       {size(m.temp_bytes):>11}   activations, gradients, loss",
        (f"  total             {size(m.total_bytes):>11}   of {size(m.usable_bytes)} usable "
         f"({size(m.gpu_bytes)} x {m.memory_fraction:g}): {'fits' if m.fits else 'DOES NOT FIT'}"),
    ]
    if m.largest_batch is not None:
        lines.append(f"  largest per-device batch that fits: {m.largest_batch} "
                     f"(bisection, {m.largest_batch_compiles} compiles)")
    if m.accum_freq_needed is None:
        lines.append("  no gradient accumulation makes this per-device batch fit")
    elif m.accum_freq_needed > 1 and not m.fits:
        lines.append(f"  gradient accumulation needed: accum_freq={m.accum_freq_needed} "
                     f"(micro-batches of {s.batch_size // m.accum_freq_needed})")
    elif m.accum_freq_needed != s.accum_freq:
        lines.append("  gradient accumulation not needed: the whole per-device batch fits (accum_freq=1)")
    else:
        lines.append(f"  gradient accumulation {'not needed' if s.accum_freq == 1 else 'as configured'}")
    return lines


def _step_program_lines(p: Plan) -> list[str]:
    program = p.step_program
    if not program:
        return []
    c = program.collectives
    moved = [f"{kind} {c.count[kind]} ({size(c.bytes[kind])}{_by_dtype(c, kind)})" for kind in c.count
             if c.count[kind]]
    attention = program.fused_attention_calls
    return ["", "the compiled step (XLA:GPU), per device and step",
            f"  collectives: {', '.join(moved) or 'none'}",
            (f"  cuDNN fused attention: {attention['forward']} forward and {attention['backward']} backward "
             "call sites" if attention["forward"] else "  cuDNN fused attention: not used")]


def _by_dtype(c, kind: str) -> str:
    """": f32 1.2 GiB, bf16 3.4 MiB": what a kind of collective moves, by element type, largest first."""
    split = sorted(((n, dtype) for dtype, n in c.bytes_by_dtype.get(kind, {}).items() if n), reverse=True)
    return (": " + ", ".join(f"{dtype} {size(n)}" for n, dtype in split)) if split else ""


def _gpu_table_lines(p: Plan) -> list[str]:
    lines = [(f"GPUs (same MFU rule; largest batch of {p.gpu} compiled, others from an affine fit of the "
              "compiled memory)"),
             (f"  {'gpu':<11}{'GiB':>7}{'bf16 TF':>9}{'tf32 TF':>9}{'MFU':>7}{'samples/s':>11}{'max batch':>11}"
              f"{'days':>8}")]
    for row in p.gpu_table:
        days = f"{row.days:.1f}" if row.days is not None else "-"
        largest = "-" if row.largest_batch is None else str(row.largest_batch)
        lines.append(f"  {row.gpu:<11}{row.memory_gib:>7.1f}{row.bf16_tflops:>9g}{row.tf32_tflops:>9g}"
                     f"{row.mfu:>7.1%}{row.samples_per_s_per_gpu:>11.1f}{largest:>11}{days:>8}")
    return lines


def format_plan(p: Plan) -> str:
    """The plan as a human-readable report."""
    s, f, params = p.setup, p.flops_per_sample, p.parameters
    lines = [
        f"plan: {p.model} on {p.gpus} x {p.gpu}",
        *(f"  note: {note}" for note in p.notes),
        (f"  {s.precision}, remat {s.remat_policy}, fsdp {'on' if s.fsdp else 'off'}, attention "
         f"{s.attention}; per-device batch {s.batch_size}, accum_freq {s.accum_freq}, global batch "
         f"{s.global_batch:,}" + (f"; NaFlex, {s.max_num_patches} patches an image" if s.max_num_patches else "")),
        "",
        (f"parameters          {params.total:,} (image {params.image:,}, text {params.text:,}, "
         f"logit_scale {params.logit_scale})"),
        "",
        ("FLOPs per sample (GFLOP)       analytic     XLA " + (
            f"(compiled at per-device batch {f.counted_at_batch})" if f.counted_at_batch is not None
            else "(not counted: --noxla_flops)")),
        f"  forward                     {_gflop(f.forward_analytic):>9}  {_gflop(f.forward_xla):>11}",
        (f"  train step (3x forward)     {_gflop(f.train_analytic):>9}  {_gflop(f.train_xla):>11}"
         "   XLA also counts norms, softmax, GELU, loss, AdamW"),
    ]
    if s.remat_policy != "none":
        remat_xla = "-" if f.remat_extra_xla is None else "+" + _gflop(f.remat_extra_xla)
        lines.append(f"  + remat ({s.remat_policy})"[:30].ljust(30)
                     + f"{'+' + _gflop(f.remat_extra_analytic):>9}  {remat_xla:>11}"
                     "   analytic: every block again (upper bound)")
    lines += ["", *_memory_lines(p), *_step_program_lines(p)]
    lines += ["", *_throughput_lines(p), *profile_lines(p.predicted_step)]
    d = p.data_loading
    lines += [
        "",
        (f"data loading: {d.cores_per_gpu:.2f} CPU cores per GPU at the measured {d.samples_per_core_s:g} "
         f"samples per core-second; config: {d.workers_per_process} workers per process"),
        "",
    ]
    r = p.run
    if r:
        cost = f", ${r.cost:,.0f} at ${r.price_per_gpu_hour:.2f} per GPU-hour" if r.cost is not None else ""
        lines.append(f"run: {r.epochs} epochs x {r.samples_per_epoch:,} = {r.samples / 1e9:.2f}B samples, "
                     f"{r.steps:,} steps: {r.days:.1f} days, {r.gpu_hours:,.0f} GPU-hours{cost}")
    else:
        lines.append("run: length unknown (set train_num_samples in the config)")
    lines += ["", *_gpu_table_lines(p)]
    if p.memory_per_device.compiler == "gpu":
        lines += ["", ("measured here: parameters and FLOPs (XLA:CPU), memory and collectives (XLA:GPU, compiled for "
                       "the GPU without one);")]
    else:
        lines += ["", ("measured here: parameters, FLOPs and memory, by compiling the step with XLA:CPU (XLA:GPU fuses "
                       "and schedules differently, and cuDNN attention keeps no score matrix: install '.[gpu]' for "
                       "its figures);")]
    predicted = p.throughput.predicted_samples_per_s is not None and p.throughput.mfu_source != "given (--mfu)"
    lines.append("modelled: speed, time and cost, from the " + ("step predicted above" if predicted else "MFU above"))
    return "\n".join(lines)


def _throughput_lines(p: Plan) -> list[str]:
    s, t = p.setup, p.throughput
    rule = (f"MFU {t.mfu:.1%} of the {s.precision} peak {t.peak_tflops:g} TFLOP/s ({t.mfu_source})")
    if t.predicted_samples_per_s is None:
        return ["throughput (modelled: MFU x peak / model FLOPs)", f"  {rule}",
                f"  {t.samples_per_s_per_gpu:.1f} samples/s per GPU, {t.samples_per_s:,.0f} samples/s on {p.gpus}"]
    step = p.predicted_step
    predicted = t.predicted_samples_per_s
    lines = ["throughput (predicted from the compiled XLA:GPU program: each kernel's FLOPs or bytes at fitted rates)",
             f"  {predicted:.1f} samples/s per GPU, {predicted * p.gpus:,.0f} samples/s on {p.gpus}: "
             f"a step of {step.seconds * 1e3:.1f} ms at {s.batch_size} per GPU",
             "  step split: " + ", ".join(f"{part} {seconds * 1e3:.1f} ms ({seconds / step.seconds:.0%})"
                                          for part, seconds in t.predicted_step_split.items()
                                          if seconds or part != "custom_calls"),
             f"  {step.calibration}",
             f"  the MFU rule instead: {rule}: {t.mfu_rule_samples_per_s_per_gpu:.1f} samples/s per GPU"]
    if t.mfu_source == "given (--mfu)":
        lines.append(f"  the run below takes the given MFU's {t.samples_per_s_per_gpu:.1f} samples/s per GPU")
    else:
        lines.append("  " + which_to_trust(predicted, t.mfu_rule_samples_per_s_per_gpu, t.mfu))
    return lines


def which_to_trust(predicted: float, rule: float, rule_mfu: float) -> str:
    """The line that says which of the two speeds (samples/s per GPU) to believe: the prediction, which times the
    step's own kernels, where the rule applies one MFU to every model."""
    ratio = rule / predicted
    if 0.8 <= ratio <= 1.25:
        return f"the two agree within {abs(ratio - 1):.0%}; the run below takes the prediction"
    return (f"trust the prediction (the run below takes it): it times this step's own kernels, an MFU of "
            f"{rule_mfu / ratio:.1%}; the rule assumes {rule_mfu:.1%} for every model, {ratio:.1f}x "
            f"{'too fast' if ratio > 1 else 'too slow'} here")


def profile_lines(step: PredictedStep | None) -> list[str]:
    """The deviceless profile: the slowest kernels, then those the prediction could not cost as it costs the rest."""
    if step is None:
        return []
    lines = ["", f"deviceless profile: the {len(step.slowest)} kernels with the most predicted time, per step",
             f"  {'ms':>8} {'share':>6} {'runs':>5}  {'part':<12}{'bound':<8}kernel: model operation"]
    for row in step.slowest:
        lines.append(f"  {row.seconds * 1e3:>8.2f} {row.share:>6.1%} {row.runs:>5}  {row.part:<12}{row.bound:<8}"
                     f"{row.kernel}: {row.operation}")
    if step.unknown:
        share = sum(row.share for row in step.unknown)
        names = ", ".join(f"{row.kernel} ({row.operation})" for row in step.unknown[:5])
        more = f" and {len(step.unknown) - 5} more" if len(step.unknown) > 5 else ""
        lines.append(f"  {len(step.unknown)} kernels without a cost rule, costed as memory-bound: {names}{more}: "
                     f"{share:.1%} of the step")
    if step.unmeasured:
        share = sum(row.share for row in step.unmeasured)
        names = ", ".join(sorted({row.operation for row in step.unmeasured}))
        lines.append(f"  {len(step.unmeasured)} Pallas kernels no GPU has timed, priced at the fitted memory-bound "
                     f"efficiency (their operand and result bytes): {names}: {share:.1%} of the step")
    return lines
