#!/usr/bin/env bash
# ViT-L/14 train-step measurements on one GPU, clip_jax against OpenCLIP (benchmarks/gpu_suite.py says what runs).
#
#   bash benchmarks/gpu_suite.sh --fetch-wheels     # where PyPI is reachable: the wheels the GPU image lacks -> .whl/
#   bash benchmarks/gpu_suite.sh [ARGS...]          # on the GPU machine, from the repository root; ARGS go to
#                                                   # gpu_suite.py (e.g. --phases core --time-budget 400)
#   bash benchmarks/gpu_suite.sh --tiny             # smoke test on any machine: tiny model, tiny batches
#
# The next lease (issue 54's step with the adopted XLA flags, OpenCLIP beside it, each flag's numerics, the Pallas
# kernels, the blocks unrolled; it prints its expected GPU time first, and --estimate prints only that):
#   bash benchmarks/gpu_suite.sh --phases matmul,specs --precisions bf16 \
#     --specs benchmarks/specs/h200_memory_bound.json --profile --steps 5 --time-budget 560
#
# Results go to $OUT (default benchmarks/out): gpu_suite.jsonl, gpu_suite.txt, gpu_env.json. Wheels in $WHEELS
# (default .whl) are installed into a private folder first, for images without OpenCLIP (and ftfy, which it imports).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
OUT=${OUT:-benchmarks/out}
# What the GPU image (Python 3.12, torch, jax, flax, optax) lacks for this suite; pure-Python wheels.
NEEDED_WHEELS=(open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4)

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    -d "$WHEELS" "${NEEDED_WHEELS[@]}"
  ls "$WHEELS"
  exit 0
fi

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$(mktemp -d /tmp/gpu_suite_site.XXXXXX)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
# One process per run, alone on the GPU: let JAX take most of its memory (its default is 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export PYTHONUNBUFFERED=1

"$PYTHON" -c "import jax, torch, open_clip; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__,
      'cuda' if torch.cuda.is_available() else 'cpu', '| open_clip', open_clip.__version__)"
exec "$PYTHON" benchmarks/gpu_suite.py --out "$OUT" "$@"
