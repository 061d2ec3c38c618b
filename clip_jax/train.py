"""Train CLIP: `python -m clip_jax.train --config configs/demo.py [--config.lr=5e-4 ...]`.

The command line of `clip_jax.training.trainer`, where its options are described."""

from clip_jax import cli
from clip_jax.training.trainer import main

if __name__ == "__main__":
    cli.run(main)
