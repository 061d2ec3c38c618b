"""CLIPScore of images and their captions: `python -m clip_jax.score --checkpoint MODEL --images ... --output FILE.csv`.

The command line of `clip_jax.evaluation.clip_score`, where its options are described."""

import sys

from clip_jax.evaluation.clip_score import main

if __name__ == "__main__":
    sys.exit(main())
