"""Training: the run loop (`trainer`, its stop signals: `clip_jax.runtime.stop_signals`) driving a task (`task`:
CLIP pretraining in `pretraining`, classification fine-tuning with WiSE-FT in `finetuning`), the commands, run
set-up and resume, the train steps and their factory, the losses, spike telemetry and stability."""
