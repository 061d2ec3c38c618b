"""Device and host telemetry for the log lines: what a person watching a long run checks first.

Per local accelerator through NVML (`nvidia-ml-py`, module `pynvml`): utilisation, memory used and total,
temperature and power; per local JAX device its allocator's `memory_stats()` (bytes in use, peak, limit); on the
host CPU and RAM use (psutil). Everything is read only when a log line is written, so the cost is a few
microseconds per logging step. A source that is missing (no NVML library, no NVIDIA driver, a backend without
memory stats) leaves its fields out and says why once in `notes`: a field is never filled with a made-up value.

The NVML module is a parameter, so a test can hand in a fake one at this boundary.
"""

import os
from collections.abc import Sequence
from typing import Any

MEMORY_WARNING_FRACTION = 0.9  # warn when a device's memory use passes this
LOW_UTILISATION = 0.7  # ... or when its utilisation stays under this ...
LOW_UTILISATION_WINDOWS = 3  # ... for this many logging windows in a row
AUTO = "auto"


def load_nvml(nvml: Any = AUTO) -> tuple[Any | None, str | None]:
    """(initialised NVML module, None), or (None, why there is none). `nvml`: a module with pynvml's functions,
    None (off), or AUTO (import pynvml)."""
    if nvml is None:
        return None, "GPU telemetry off"
    if nvml == AUTO:
        try:
            import pynvml as nvml
        except ImportError:
            return None, "no GPU telemetry: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no NVIDIA driver on this machine
        return None, f"no GPU telemetry: NVML did not start ({e})"
    if count == 0:
        return None, "no GPU telemetry: NVML sees no GPU"
    return nvml, None


def visible_gpu_indices(count: int, cuda_visible_devices: str | None) -> list[int]:
    """NVML indices of the GPUs this process uses: NVML counts every GPU of the machine, CUDA only those
    CUDA_VISIBLE_DEVICES names (numbers; UUIDs and an unset variable mean all of them)."""
    if cuda_visible_devices:
        try:
            indices = [int(x) for x in cuda_visible_devices.split(",") if x.strip()]
        except ValueError:
            return list(range(count))
        return [i for i in indices if 0 <= i < count]
    return list(range(count))


def _optional(read, *args):
    """An NVML reading, or None when this GPU does not support it (power on some boards)."""
    try:
        return read(*args)
    except Exception:
        return None


def nvml_scalars(nvml, handles: Sequence[Any]) -> dict[str, float]:
    """Per GPU `gpu{i}_utilization` (fraction of the last sample period with a kernel running), `gpu{i}_memory_used`
    and `gpu{i}_memory_total` (bytes), `gpu{i}_temperature_c`, `gpu{i}_power_w`; and over the GPUs their min and
    mean utilisation, the highest memory fraction and temperature, and the total power."""
    out: dict[str, float] = {}
    utils, fractions, temps, powers = [], [], [], []
    for i, handle in enumerate(handles):
        util = _optional(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = _optional(nvml.nvmlDeviceGetMemoryInfo, handle)
        temp = _optional(nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        power_mw = _optional(nvml.nvmlDeviceGetPowerUsage, handle)
        if util is not None:
            out[f"gpu{i}_utilization"] = util.gpu / 100
            utils.append(util.gpu / 100)
        if memory is not None:
            out[f"gpu{i}_memory_used"], out[f"gpu{i}_memory_total"] = float(memory.used), float(memory.total)
            fractions.append(memory.used / max(memory.total, 1))
        if temp is not None:
            out[f"gpu{i}_temperature_c"] = float(temp)
            temps.append(float(temp))
        if power_mw is not None:
            out[f"gpu{i}_power_w"] = power_mw / 1000
            powers.append(power_mw / 1000)
    if utils:
        out["gpu_utilization_min"], out["gpu_utilization_mean"] = min(utils), sum(utils) / len(utils)
    if fractions:
        out["gpu_memory_fraction_max"] = max(fractions)
    if temps:
        out["gpu_temperature_max_c"] = max(temps)
    if powers:
        out["gpu_power_w_total"] = sum(powers)
    return out


def jax_memory_scalars(devices: Sequence[Any]) -> dict[str, float]:
    """`device{i}_bytes_in_use`, `device{i}_peak_bytes_in_use`, `device{i}_bytes_limit` from each device's
    allocator, and `device_memory_fraction_max` (in use / limit); {} where the backend keeps no stats (CPU)."""
    out: dict[str, float] = {}
    fractions = []
    for i, device in enumerate(devices):
        stats = _optional(device.memory_stats) or {}
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if key in stats:
                out[f"device{i}_{key}"] = float(stats[key])
        if stats.get("bytes_limit"):
            fractions.append(stats.get("bytes_in_use", 0) / stats["bytes_limit"])
    if fractions:
        out["device_memory_fraction_max"] = max(fractions)
    return out


def host_scalars(psutil) -> dict[str, float]:
    """`host_cpu_percent` (all cores, since the previous call), `host_ram_used` and `host_ram_total` (bytes),
    `process_rss` (this process, bytes)."""
    memory = psutil.virtual_memory()
    return {"host_cpu_percent": float(psutil.cpu_percent(interval=None)), "host_ram_used": float(memory.used),
            "host_ram_total": float(memory.total), "process_rss": float(psutil.Process().memory_info().rss)}


class Telemetry:
    """Reads the sources once per log line. `notes`: one line per missing source, for the run to print once."""

    def __init__(self, *, nvml: Any = AUTO, devices: Sequence[Any] = (), host: bool = True,
                 cuda_visible_devices: str | None = None):
        self.notes: list[str] = []
        self.nvml, why = load_nvml(nvml)
        self.handles = []
        if self.nvml is None:
            self.notes.append(why)
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES") if cuda_visible_devices is None else cuda_visible_devices
            indices = visible_gpu_indices(self.nvml.nvmlDeviceGetCount(), visible)
            self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self.devices = list(devices)
        if self.devices and not jax_memory_scalars(self.devices):
            self.notes.append(f"no device memory stats: the {self.devices[0].platform} backend keeps none")
        self.psutil = None
        if host:
            try:
                import psutil

                psutil.cpu_percent(interval=None)  # starts the CPU measurement window
                self.psutil = psutil
            except ImportError:
                self.notes.append("no host telemetry: psutil is not installed")
        self._low_windows = 0

    def sample(self) -> dict[str, float]:
        out = {}
        if self.handles:
            out.update(nvml_scalars(self.nvml, self.handles))
        out.update(jax_memory_scalars(self.devices))
        if self.psutil is not None:
            out.update(host_scalars(self.psutil))
        return out

    def warnings(self, scalars: dict[str, float]) -> list[str]:
        """Warning lines for one logging window's `scalars`: memory past MEMORY_WARNING_FRACTION (every window it
        is), utilisation under LOW_UTILISATION for LOW_UTILISATION_WINDOWS windows in a row (once, when that
        happens, and again after it recovered and dropped again)."""
        lines = []
        memory = max(scalars.get("gpu_memory_fraction_max", 0.0), scalars.get("device_memory_fraction_max", 0.0))
        if memory > MEMORY_WARNING_FRACTION:
            lines.append(f"warning: device memory at {100 * memory:.0f}% (over {100 * MEMORY_WARNING_FRACTION:.0f}%):"
                         " a longer sequence or a fragmentation spike may run out; consider a smaller batch_size, "
                         "grad_checkpointing or fsdp")
        util = scalars.get("gpu_utilization_min")
        if util is None:
            return lines
        self._low_windows = self._low_windows + 1 if util < LOW_UTILISATION else 0
        if self._low_windows == LOW_UTILISATION_WINDOWS:
            lines.append(f"warning: GPU utilisation under {100 * LOW_UTILISATION:.0f}% for {LOW_UTILISATION_WINDOWS} "
                         f"log windows (lowest GPU now {100 * util:.0f}%): check the data wait, or raise batch_size")
        return lines

    def close(self) -> None:
        if self.nvml is not None:
            _optional(self.nvml.nvmlShutdown)
            self.nvml, self.handles = None, []


def progress_parts(scalars: dict[str, float]) -> list[str]:
    """The progress line's telemetry fields, for those present."""
    parts = []
    if "gpu_utilization_mean" in scalars:
        mean, low = 100 * scalars["gpu_utilization_mean"], 100 * scalars["gpu_utilization_min"]
        parts.append(f"GPU {mean:.0f}% (min {low:.0f}%)")
    if "gpu_memory_fraction_max" in scalars:
        parts.append(f"mem {100 * scalars['gpu_memory_fraction_max']:.0f}%")
    elif "device_memory_fraction_max" in scalars:
        parts.append(f"mem {100 * scalars['device_memory_fraction_max']:.0f}%")
    if "gpu_temperature_max_c" in scalars:
        parts.append(f"{scalars['gpu_temperature_max_c']:.0f}C")
    if "gpu_power_w_total" in scalars:
        parts.append(f"{scalars['gpu_power_w_total']:.0f}W")
    if "host_cpu_percent" in scalars:
        parts.append(f"host CPU {scalars['host_cpu_percent']:.0f}% RAM "
                     f"{100 * scalars['host_ram_used'] / max(scalars['host_ram_total'], 1):.0f}%")
    return parts
