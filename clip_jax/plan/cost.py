"""The modelled part of a plan: speed at a stated MFU, data loading, the run's length and cost, other GPUs.

The MFU rule: samples/s = MFU x peak FLOP/s / model FLOPs per sample, with clip_jax's own measured MFU where there is
one and the published reference run's otherwise. It is the planner's speed where no XLA:GPU program is compiled (or
`--mfu` is given); with one, `clip_jax.plan.step_time` predicts the step from its kernels and the rule is reported
beside it.
"""

from clip_jax.models import get_model_config
from clip_jax.models.flops import train_flops
from clip_jax.plan.result import GpuRow, RunLength
from clip_jax.runtime.hardware import GPU, GPUS, get_gpu

# OpenCLIP's ViT-L/14 LAION-2B run: 72.6 samples/s per A100-40GB (27,862 on 384). Without a measurement of our own,
# the default MFU is the model FLOP rate that run reached, as a fraction of the A100's peak for the planned precision.
REFERENCE_SAMPLES_PER_S = 72.6
REFERENCE_GPU = "a100-40gb"
REFERENCE_MODEL = "ViT-L-14"
# clip_jax's own GPU measurements, (gpu, precision) -> (MFU, where it was recorded); used before the reference.
MEASURED_MFU: dict[tuple[str, str], tuple[float, str]] = {
    ("h200", "bf16"): (0.317, "measured: clip_jax's ViT-L-14 bf16 step on one H200, remat dots_saveable, cuDNN "
                              "attention, batch 256: 596.7 samples/s (benchmarks/RESULTS.md, 2026-11-30)"),
    ("h200", "fp32"): (0.282, "measured: clip_jax's ViT-L-14 fp32 step on one H200, remat dots_saveable, batch 256: "
                              "264.7 samples/s (benchmarks/RESULTS.md, 2026-11-30)"),
}
# benchmarks/data_pipeline.py, 2026-11-30: read + decode + RandomResizedCrop(224) + normalise + tokenize + batch,
# 256 px JPEGs, samples per CPU-second on one core of an Intel Xeon (larger source images decode slower).
PIPELINE_SAMPLES_PER_CORE_S = 329.0


def default_mfu(gpu: GPU, precision: str) -> tuple[float, str]:
    """(MFU, where it comes from): clip_jax's own measurement when there is one, else the reference run's."""
    if (gpu.name, precision) in MEASURED_MFU:
        return MEASURED_MFU[gpu.name, precision]
    reference_gpu = get_gpu(REFERENCE_GPU)
    flop_rate = REFERENCE_SAMPLES_PER_S * train_flops(get_model_config(REFERENCE_MODEL))
    mfu = flop_rate / (reference_gpu.peak_tflops(precision) * 1e12)
    return mfu, (f"assumed: the reference run's {REFERENCE_SAMPLES_PER_S} samples/s per {REFERENCE_GPU} "
                 f"({flop_rate / 1e12:.1f} TFLOP/s) over that GPU's {precision} peak; no clip_jax GPU "
                 "measurement yet")


def samples_per_s_per_gpu(mfu: float, gpu: GPU, precision: str, model_train_flops: float) -> float:
    return mfu * gpu.peak_tflops(precision) * 1e12 / model_train_flops


def run_length(config, global_batch: int, samples_per_s: float, num_gpus: int,
               price: float | None) -> RunLength | None:
    """Steps, time, GPU-hours and cost of `epochs x train_num_samples`, counted in whole steps as the trainer runs."""
    if not config.train_num_samples:
        return None
    from clip_jax import data  # here, so that the rest of the planner runs without the input pipeline's deps

    data_config = data.TrainDataConfig(shards=config.train_data or "unused", workers=config.workers,
                                       train_num_samples=config.train_num_samples, check_shards_exist=False)
    steps = config.epochs * data.steps_per_epoch(data_config, global_batch)
    seconds = steps * global_batch / samples_per_s
    gpu_hours = seconds * num_gpus / 3600
    return RunLength(epochs=config.epochs, samples_per_epoch=config.train_num_samples,
                     samples=config.epochs * config.train_num_samples, steps=steps,
                     samples_in_steps=steps * global_batch, seconds=seconds, days=seconds / 86400,
                     gpu_hours=gpu_hours, price_per_gpu_hour=price, cost=None if price is None else gpu_hours * price)


def gpu_table(precision: str, model_train_flops: float, mfu: float | None, memory_fraction: float, num_gpus: int,
              run: RunLength | None, *, exact: tuple[str, int | None],
              fit: tuple[float, float] | None) -> tuple[GpuRow, ...]:
    """Every known GPU: peaks, memory, speed at the MFU rule, largest batch (compiled for one, else the fit), days."""
    rows = []
    for gpu in GPUS.values():
        if not gpu.peak_tflops(precision):  # no such matmuls: bfloat16 before Ampere
            continue
        gpu_mfu = mfu if mfu is not None else default_mfu(gpu, precision)[0]
        rate = samples_per_s_per_gpu(gpu_mfu, gpu, precision, model_train_flops)
        budget = int(gpu.memory_bytes * memory_fraction)
        if gpu.name == exact[0] and exact[1] is not None:
            largest, how = exact[1], "compiled"
        elif fit is not None and fit[1] > 0:
            largest, how = max(0, int((budget - fit[0]) // fit[1])), "affine fit"
        else:
            largest, how = None, "unknown"
        rows.append(GpuRow(gpu=gpu.name, memory_gib=round(gpu.memory_gib, 1), bf16_tflops=gpu.bf16_tflops,
                           tf32_tflops=gpu.tf32_tflops, mfu=gpu_mfu, samples_per_s_per_gpu=rate,
                           largest_batch=largest, largest_batch_from=how,
                           days=run.samples_in_steps / (rate * num_gpus) / 86400 if run else None))
    return tuple(rows)
