"""CLIP_benchmark's command line over clip_jax models: `python -m clip_jax.benchmark eval|build ...`.

    python -m clip_jax.benchmark eval --dataset wds/vtab/cifar10 --dataset_root "/data/wds_{dataset_cleaned}" \\
        --pretrained export/ --task linear_probe

The flags are CLIP_benchmark's (`clip_benchmark eval`); they are described in `clip_jax.evaluation.benchmark_cli`."""

import sys

from clip_jax.evaluation.benchmark_cli import main

if __name__ == "__main__":
    sys.exit(main())
