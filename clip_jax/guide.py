"""An image moved towards a prompt by CLIP guidance: `python -m clip_jax.guide --checkpoint MODEL --prompt TEXT
--output FILE.png`.

The command line of `clip_jax.interop.guide`, where its options are described."""

import sys

from clip_jax.interop.guide import main

if __name__ == "__main__":
    sys.exit(main())
