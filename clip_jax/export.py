"""Export a model as the folder OpenCLIP and transformers load: `python -m clip_jax.export RUN_DIR OUT_DIR`.

The command line of `clip_jax.interop.export`, where its options are described."""

import sys

from clip_jax.interop.export import main

if __name__ == "__main__":
    sys.exit(main())
