"""Train CLIP: `python -m clip_jax.train --config configs/demo.py [--config.lr=5e-4 ...]`.

The command line of the run loop (`clip_jax.training.command`, `clip_jax.training.trainer`), where its options are
described. A stop signal is remembered from the first line on, before the trainer's imports (seconds); data
workers, which import this module again as they start, import nothing more from it."""

if __name__ == "__main__":
    from clip_jax.runtime.stop_signals import StopSignal

    _STOP = StopSignal()

    from clip_jax.training import command

    command.run("pretraining", stop=_STOP)
