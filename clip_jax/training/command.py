"""The command line of the run loop (`clip_jax.training.trainer`): `python -m clip_jax.train --config
configs/demo.py` (CLIP pretraining) and `python -m clip_jax.finetune --config configs/demo_finetune.py`
(classification fine-tuning), `[--config.FIELD=VALUE ...]`. Both join the processes of a multi-process run and
leave it the same way; exit 0 when the run is done or a stop signal was saved in a checkpoint, 1 for a run that
failed, 2 for other user errors (a config of the other command among them), 130 when a stop signal came before
there was anything to save (one line each)."""

import functools
import logging
import sys
from collections.abc import Callable

import ml_collections
from absl import logging as absl_logging
from ml_collections import config_flags

from clip_jax import cli
from clip_jax.errors import InvalidInput
from clip_jax.run_config import default_config
from clip_jax.runtime import entry, storage_faults
from clip_jax.runtime.processes import initialize_from_environment
from clip_jax.runtime.stop_signals import StopSignal
from clip_jax.training.finetune_config import default_finetune_config
from clip_jax.training.task import COMMANDS, is_finetune_config
from clip_jax.training.trainer import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "the run's config file (configs/*.py)", lock_config=True)
DEFAULTS = {"pretraining": default_config, "fine-tuning": default_finetune_config}
EXAMPLES = {"pretraining": "configs/demo.py", "fine-tuning": "configs/demo_finetune.py"}


def run(task: str, stop: StopSignal | None = None) -> None:
    """The command of `task` ("pretraining" or "fine-tuning"): a config file's fields are checked against the
    task's defaults as it loads (the other task's config is named as such), then `main`."""
    others = {COMMANDS[other]: defaults for other, defaults in DEFAULTS.items() if other != task}
    cli.expect_fields(DEFAULTS[task], others=others)
    cli.run(functools.partial(main, task=task, stop=stop))


@entry.command(interrupts=False)  # the run takes stop signals itself: it saves, then stops
def main(argv, *, task: str = "pretraining", stop: StopSignal | None = None) -> int:
    """`stop`: a StopSignal installed before the trainer was imported (clip_jax/train.py); else one from here."""
    if len(argv) > 1:
        raise InvalidInput(f"unexpected arguments {argv[1:]}; settings go in --config.FIELD=VALUE")
    config = _CONFIG.value
    if config is None:
        raise InvalidInput(f"give a config: --config {EXAMPLES[task]}")
    run_task(config, task, stop or StopSignal())
    return 0


def run_task(config, task: str, stop: StopSignal, complete: Callable[[ml_collections.ConfigDict], None] | None = None
             ) -> None:
    """Runs `config` as a run of `task`; `complete(config)`, where given, fills in what is known only once the
    processes have joined (OpenCLIP's run name: `clip_jax.training.open_clip_command`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    absl_logging.set_verbosity(absl_logging.WARNING)  # jax's backend probing is not news
    try:
        check_task(config, task)
        # A multi-process run joins before anything touches the devices, and looks at a signal only once joined:
        # the processes then agree on it (a process that left before joining would keep the others waiting).
        joined = initialize_from_environment()
        stop.raise_if_received("while the processes joined" if joined else "while the trainer loaded")
        if complete is not None:
            complete(config)
        with storage_faults.quiet_orbax_records():  # the run tells a full disk in one line
            train(config, stop=stop)
    finally:
        stop.restore()


def check_task(config, task: str) -> None:
    """An InvalidInput naming the command when `config` is the other task's."""
    given = "fine-tuning" if is_finetune_config(config) else "pretraining"
    if given != task:
        raise InvalidInput(f"this is a {given} config: run it with {COMMANDS[given]}")
