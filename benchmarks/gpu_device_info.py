"""The properties of the local GPU that an XLA:GPU target config is made of, read from the CUDA runtime.

    python benchmarks/gpu_device_info.py OUT.json     # on a GPU machine (needs cupy or torch)

`clip_jax/runtime/hardware.py` ships a target config per GPU for deviceless compiles; this records the real device's
numbers (multiprocessors, clocks, memory, caches, per-block and per-multiprocessor limits, cuDNN and CUDA versions) so
that a shipped config can be checked against a device, field by field.
"""

import json
import subprocess
import sys

# cudaDeviceAttr numbers (CUDA runtime API) for the fields that cudaDeviceProp no longer carries in CUDA 13.
ATTRIBUTES = {"clock_rate_khz": 13, "memory_clock_rate_khz": 36, "global_memory_bus_width_bits": 37}


def cuda_properties() -> dict:
    import cupy

    runtime = cupy.cuda.runtime
    properties = {key: (value.decode(errors="replace") if isinstance(value, bytes) else value)
                  for key, value in runtime.getDeviceProperties(0).items()
                  if isinstance(value, (int, float, str, bytes, tuple, list))}
    for name, attribute in ATTRIBUTES.items():
        try:
            properties[name] = runtime.deviceGetAttribute(attribute, 0)
        except Exception as error:  # noqa: BLE001 - recorded, not fatal
            properties[name] = f"unavailable: {error}"
    properties["runtime_version"] = runtime.runtimeGetVersion()
    properties["driver_version"] = runtime.driverGetVersion()
    return properties


def main() -> None:
    info = {}
    try:
        info["cuda"] = cuda_properties()
    except Exception as error:  # noqa: BLE001
        info["cuda"] = f"unavailable: {error}"
    try:
        import torch

        info["torch"] = {"version": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                         "name": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability()}
    except Exception as error:  # noqa: BLE001
        info["torch"] = f"unavailable: {error}"
    try:
        import jax

        device = jax.devices()[0]
        info["jax"] = {"version": jax.__version__, "device_kind": device.device_kind,
                       "memory_stats": device.memory_stats()}
    except Exception as error:  # noqa: BLE001
        info["jax"] = f"unavailable: {error}"
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=30,
                                            check=False).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired) as error:
        info["nvidia_smi"] = f"unavailable: {error}"
    text = json.dumps(info, indent=2, default=str)
    with open(sys.argv[1], "w") as f:
        f.write(text + "\n")
    print(text[:3000])


if __name__ == "__main__":
    main()
