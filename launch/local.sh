#!/usr/bin/env bash
# N local training processes joined with gloo: launch/local.sh N [--config configs/demo.py ...]
# Thin wrapper over launch/local.py with 4 simulated CPU devices per process.
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: launch/local.sh N [trainer flags...], e.g. launch/local.sh 2 --config configs/demo.py" >&2
    exit 2
fi
N="$1"; shift
PYTHON="${PYTHON:-python}"
cd "$(dirname "$0")/.."
exec "$PYTHON" launch/local.py "$N" --devices-per-process "${DEVICES_PER_PROCESS:-4}" -- \
    "$PYTHON" -m clip_jax.train "$@"
