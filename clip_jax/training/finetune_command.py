"""The command line of classification fine-tuning (`python -m clip_jax.finetune --config configs/demo_finetune.py
[--config.FIELD=VALUE ...]`, see `clip_jax.training.finetuner`): exit 0 when the run is done (or a stop signal was
saved in a checkpoint), 1 for a run that failed, 2 for other user errors (one line each)."""

import sys

from absl import app
from absl import logging as absl_logging
from ml_collections import config_flags

from clip_jax import cli
from clip_jax.errors import UserError, exit_status
from clip_jax.runtime import storage_faults, xla_gpu
from clip_jax.runtime.stop_signals import EXIT_STOPPED, Stopped, StopSignal
from clip_jax.training.finetune_config import default_finetune_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "fine-tuning config file (configs/demo_finetune.py)",
                                          lock_config=True)
cli.expect_fields(default_finetune_config)  # a misspelled field in the file is named before anything is built


def main(argv, stop: StopSignal | None = None) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; settings go in --config.FIELD=VALUE")
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("give a config: --config configs/demo_finetune.py")
    stop = stop or StopSignal()
    absl_logging.set_verbosity(absl_logging.WARNING)
    xla_gpu.quiet_cuda_plugin()  # no CUDA start-up traceback on a machine without a GPU
    from clip_jax.training.finetuner import finetune

    try:
        stop.raise_if_received("while the fine-tuner loaded")
        with storage_faults.quiet_orbax_records():  # the run tells a full disk in one line
            finetune(config, stop=stop)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_status(e)
    except Stopped as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_STOPPED
    finally:
        stop.restore()
    return 0
