"""Fine-tune CLIP for classification with WiSE-FT: `python -m clip_jax.finetune --config configs/demo_finetune.py`.

The command line of `clip_jax.training.finetuner`, where the run is described."""

if __name__ == "__main__":
    from clip_jax.runtime.stop_signals import StopSignal

    _STOP = StopSignal()

    import functools

    from clip_jax import cli
    from clip_jax.training.finetune_command import main

    cli.run(functools.partial(main, stop=_STOP))
