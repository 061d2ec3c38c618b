#!/usr/bin/env bash
# Sets up a fresh machine for clip_jax: Debian's Fashion-MNIST (the embedded demo data) and a virtual environment
# in .venv holding clip_jax with its test extras (the real OpenCLIP package, for the parity tests) and its gpu extra
# (jaxlib's CUDA plugin: the XLA:GPU planner and its tests compile for GPUs without one).
set -euo pipefail
cd "$(dirname "$0")/.."

FASHION_MNIST=/usr/share/datasets/fashion-mnist
if [ ! -f "$FASHION_MNIST/t10k-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "Fashion-MNIST is missing: run   sudo apt-get install dataset-fashion-mnist   (Debian/Ubuntu)," >&2
    echo "or copy its four *-ubyte.gz files to $FASHION_MNIST" >&2
    exit 1
  fi
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,gpu]'
# LAION's clip-benchmark, for the agreement test (tests/test_clip_benchmark.py), without its dependencies: what the
# test calls (its webdataset reader and zero-shot metrics) needs only torch, torchvision, open_clip, webdataset, tqdm
# and scikit-learn, all in the test extra at their pinned versions; the rest (pycocotools, pycocoevalcap) serves its
# captioning paths, which the tests do not use (transformers is in the test extra for the export's own tests).
.venv/bin/python -m pip install -q --no-deps clip-benchmark==1.6.2
echo "clip_jax is set up in .venv ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
