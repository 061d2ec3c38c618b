"""Fine-tune CLIP for classification with WiSE-FT: `python -m clip_jax.finetune --config configs/demo_finetune.py`.

The command line of the run loop (`clip_jax.training.command`) with its fine-tuning task
(`clip_jax.training.finetuning`, where the run is described); a stop signal is remembered from the first line on."""

if __name__ == "__main__":
    from clip_jax.runtime.stop_signals import StopSignal

    _STOP = StopSignal()

    from clip_jax.training import command

    command.run("fine-tuning", stop=_STOP)
