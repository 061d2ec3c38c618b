"""Embeddings of an image-text collection in clip-retrieval's layout: `python -m clip_jax.embed --input_dataset ...`.

The command line of `clip_jax.evaluation.embed`, where its options are described."""

import sys

from clip_jax.evaluation.embed import main

if __name__ == "__main__":
    sys.exit(main())
