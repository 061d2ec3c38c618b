"""Training: the run config, the train step and its factory, the losses, spike telemetry, run set-up and
resume, stability, preemption, and the trainer's step loop."""
