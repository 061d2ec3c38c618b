"""Export a model as the folder OpenCLIP loads: `python -m clip_jax.export RUN_DIR_OR_CHECKPOINT OUT_DIR`.

The command line of `clip_jax.interop.export`, where its options are described."""

import sys

from clip_jax.interop.export import main

if __name__ == "__main__":
    sys.exit(main())
