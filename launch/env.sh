# Environment for every rank of a GPU training job; sourced by the sbatch scripts (and usable by hand).
# Each setting only applies when not already set, so a job can override any of them:  XLA_FLAGS=... sbatch ...

# XLA: the flags the project adopts (clip_jax.runtime.xla_gpu.ADOPTED_FLAGS, which the planner's compiles take
# too), always, first: a job's own XLA_FLAGS come after them and win (--FLAG=false switches one off). Then, unless
# the job sets XLA_FLAGS: overlap collectives with compute, and batch many small all-reduces / all-gathers /
# reduce-scatters (gradients, FSDP gathers) into few large ones.
FLAGS_PYTHON="${PYTHON:-$(command -v python || command -v python3 || echo python)}"
if ! ADOPTED_XLA_FLAGS="$("$FLAGS_PYTHON" -m clip_jax.runtime.xla_gpu)"; then
  echo "launch/env.sh: $FLAGS_PYTHON cannot run clip_jax.runtime.xla_gpu: run from the clip_jax checkout," \
       "or set PYTHON to the python clip_jax is installed in" >&2
  return 1 2>/dev/null || exit 1
fi
export XLA_FLAGS="$ADOPTED_XLA_FLAGS ${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728 \
--xla_gpu_all_gather_combine_threshold_bytes=134217728 \
--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728}"
# Let XLA take most of the GPU's memory up front (the default 75% wastes a quarter of an A100).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"

# Persistent compilation cache on shared storage: a resumed job (and every rank after the first) skips the
# minutes-long compile of the ViT-L/14 step.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}"

# NCCL: warnings only (INFO when debugging a hang); site-specific network settings are left to the cluster's
# documentation, e.g. NCCL_SOCKET_IFNAME=ib0 or NCCL_IB_HCA=mlx5.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Fail a collective whose peer is gone instead of waiting forever.
export NCCL_ASYNC_ERROR_HANDLING="${NCCL_ASYNC_ERROR_HANDLING:-1}"

# clip_jax.runtime.processes: a rank that stops sending heartbeats fails the whole job within this many seconds;
# joining waits this long for every rank.
export CLIP_JAX_HEARTBEAT_TIMEOUT="${CLIP_JAX_HEARTBEAT_TIMEOUT:-100}"
export CLIP_JAX_INIT_TIMEOUT="${CLIP_JAX_INIT_TIMEOUT:-600}"

# Data worker processes read shards on the CPU: keep BLAS/OpenMP from oversubscribing the task's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
