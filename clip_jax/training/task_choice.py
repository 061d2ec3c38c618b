"""Which task a run config describes (`task_for`): the one place that knows every task, so that the tasks and the
set-up they use import `training.task` one way."""

from collections.abc import Sequence

from clip_jax.training.task import Task, is_finetune_config


def task_for(config, evaluators: Sequence = ()) -> Task:
    """The task a config describes: classification fine-tuning (`default_finetune_config`'s fields), else CLIP
    pretraining; `evaluators`: `Scheduled` evaluations the caller adds to the config's."""
    if is_finetune_config(config):
        from clip_jax.training.finetuning import ClassificationFinetuning

        return ClassificationFinetuning(config, evaluators)
    from clip_jax.training.pretraining import ClipPretraining

    return ClipPretraining(config, evaluators)
