"""Plots of a run: `python -m clip_jax.report RUN_DIR [--output PNG]`.

The command line of `clip_jax.ops.report`, where its options are described."""

import sys

from clip_jax.ops.report import main

if __name__ == "__main__":
    sys.exit(main())
