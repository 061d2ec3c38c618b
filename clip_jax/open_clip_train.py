"""Train CLIP from an OpenCLIP launch line: `python -m clip_jax.open_clip_train --model ViT-L-14 --train-data ...`.

The command line of `clip_jax.training.open_clip_command`, where its options are described. A stop signal is
remembered from the first line on, before the trainer's imports (seconds)."""

if __name__ == "__main__":
    import sys

    from clip_jax.runtime.stop_signals import StopSignal

    _STOP = StopSignal()

    from clip_jax.training import open_clip_command

    sys.exit(open_clip_command.main(stop=_STOP))
