"""jaxlib's CUDA plugin on a machine without an NVIDIA GPU: its start-up traceback, left out.

Installed there (`pip install -e '.[gpu]'`), the plugin's start-up check fails (`cuInit(0) failed`) the first time
JAX starts its backends, and JAX logs that as a 10-line error-level traceback before it goes on with the CPU.
`quiet_cuda_plugin` drops that record where the machine shows no GPU and the platforms are not named (JAX_PLATFORMS,
or `jax.config`'s jax_platforms): there it only says that the machine has no GPU. Where a GPU is present, or the
platforms are named, it tells of a GPU that does not start, and stays. Only what is printed changes: JAX runs on the
CPU there either way.

`import clip_jax` installs it, the one process-wide setting the package makes at import, so that a script using the
library is as quiet as the commands; it imports nothing (JAX is loaded by the time such a record comes).
"""

import glob
import logging

PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
PLUGIN_LOGGER = "jax._src.xla_bridge"  # where JAX logs a plugin whose initialize() raised
NVIDIA_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg")  # the driver's; WSL's GPU


def quiet_cuda_plugin() -> None:
    """Drop the CUDA plugin's start-up traceback on a machine without an NVIDIA GPU, unless JAX_PLATFORMS is set.
    Call before anything touches a device; a second call changes nothing."""
    logging.getLogger(PLUGIN_LOGGER).addFilter(_keep_plugin_record)  # adding the same filter twice is a no-op


def _keep_plugin_record(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if not (message.startswith("Jax plugin configuration error") and any(p in message for p in PLUGINS)):
        return True
    import jax  # loaded: it is logging

    return bool(jax.config.jax_platforms) or nvidia_gpu_present()


def nvidia_gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU driver's device files (without starting CUDA)."""
    return any(glob.glob(pattern) for pattern in NVIDIA_DEVICE_FILES)
