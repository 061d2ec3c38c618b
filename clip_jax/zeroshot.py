"""Zero-shot classification and retrieval: `python -m clip_jax.zeroshot --checkpoint RUN --imagenet-val DIR ...`.

The command line of `clip_jax.evaluation.zeroshot`, where its options are described."""

import sys

from clip_jax.evaluation.zeroshot import main

if __name__ == "__main__":
    sys.exit(main())
