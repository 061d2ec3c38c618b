"""Convert weights between OpenCLIP and clip_jax: `python -m clip_jax.convert SRC DST --model NAME`.

The command line of `clip_jax.interop.weight_files`, where its options are described."""

import sys

from clip_jax.interop.weight_files import main

if __name__ == "__main__":
    sys.exit(main())
