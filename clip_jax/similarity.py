"""Encode images and captions and print how they match: `python -m clip_jax.similarity`.

The command line of `clip_jax.interop.similarity`, where its options are described."""

import sys

from clip_jax.interop.similarity import main

if __name__ == "__main__":
    sys.exit(main())
