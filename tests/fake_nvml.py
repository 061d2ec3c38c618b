"""A stand-in for NVML's Python module (pynvml), handed to `clip_jax.ops.device_telemetry` at its boundary."""

import types


class FakeNVMLError(Exception):
    pass


def fake_nvml(gpus, *, power_supported=True, init_error=None):
    """A stand-in for pynvml over `gpus`: a list of dicts with util (%), used, total (bytes), temp (C), power (mW)."""
    calls = {"init": 0, "shutdown": 0}

    def init():
        calls["init"] += 1
        if init_error:
            raise FakeNVMLError(init_error)

    def power(handle):
        if not power_supported:
            raise FakeNVMLError("Not Supported")
        return gpus[handle]["power"]

    module = types.SimpleNamespace(
        NVMLError=FakeNVMLError, NVML_TEMPERATURE_GPU=0, calls=calls, nvmlInit=init,
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=gpus[h]["util"], memory=0),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=gpus[h]["used"], total=gpus[h]["total"],
                                                                free=gpus[h]["total"] - gpus[h]["used"]),
        nvmlDeviceGetTemperature=lambda h, sensor: gpus[h]["temp"],
        nvmlDeviceGetPowerUsage=power)
    return module
