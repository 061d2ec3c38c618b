"""The train state's `policy_state` slot (`training.train_step.TrainState`): what a precision policy owns besides
its dtypes, as a run starts it, and the line a run resuming under another policy says about it. `fp16` owns its
dynamic loss scale (`training.loss_scale`); FP8's delayed scaling would keep its amax history here. Under a policy
that owns nothing the slot is None: the train state and its checkpoints are as they were before the slot existed.
A checkpoint's slot is restored by name (`runtime.checkpoints`); resumed under a policy that owns another (or
none), the saved one is dropped and the run's starts afresh."""

from clip_jax.models.precision import POLICIES, get_policy
from clip_jax.training.loss_scale import initial_loss_scale


def initial_policy_state(spec):
    """The slot as a run of `spec` (a `StepSpec`) starts it: the loss scale under a policy with `loss_scaling`,
    else None."""
    if not get_policy(spec.precision).loss_scaling:
        return None
    return initial_loss_scale(spec.loss_scale)


def resume_note(saved_precision: str | None, config) -> str | None:
    """The line a run of `config` resuming from a checkpoint saved under `saved_precision` says when the two
    policies disagree on owning a loss scale (the checkpoint's dropped, or one started afresh); else None."""
    saved = POLICIES.get(saved_precision)
    saved_scaled, scaled = saved is not None and saved.loss_scaling, get_policy(config.precision).loss_scaling
    if saved_scaled and not scaled:
        return f"the checkpoint's loss scale dropped: {config.precision} has none (saved under {saved_precision})"
    if scaled and not saved_scaled:
        return (f"loss scale started at loss_scale_init={config.loss_scale_init:g}: the checkpoint, saved under "
                f"{saved_precision}, has none")
    return None
