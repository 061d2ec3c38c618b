"""Training: the run config, the train step and its factory, the losses, spike telemetry, run set-up and
resume, stability, and the trainer's step loop (its stop signals: `clip_jax.runtime.stop_signals`)."""
