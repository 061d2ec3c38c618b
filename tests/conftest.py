"""Test set-up: eight simulated CPU devices, so sharded code runs as on a GPU node; jaxlib's CUDA plugin loads
without a GPU, for the deviceless XLA:GPU compiles (and test subprocesses inherit both settings)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # clip_jax.xla_gpu.prepare()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
