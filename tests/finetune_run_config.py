"""A fine-tuning config for tests that launch `python -m clip_jax.finetune` as a process (or as the ranks of
launch/local.py): the fields come as JSON in CLIP_JAX_TEST_CONFIG, on `default_finetune_config()`.

Test seam, since this file runs inside the fine-tuner's process: CLIP_JAX_TEST_STOP_AFTER=N makes every process
take a stop signal once it has dispatched step N, as if SIGTERM had come then; the run stops at its next stop check
(every step in one process, every few steps across several) with a checkpoint. CLIP_JAX_TESTS_XLA_CACHE (set by
tests/conftest.py): every rank reads the session's compilation cache (tests/train_config.py)."""

import json
import os
import sys

from clip_jax.training.finetune_config import default_finetune_config

STOP_AFTER = "CLIP_JAX_TEST_STOP_AFTER"


def get_config():
    c = default_finetune_config()
    for key, value in json.loads(os.environ["CLIP_JAX_TEST_CONFIG"]).items():
        c[key] = tuple(value) if isinstance(value, list) else value
    if os.environ.get(STOP_AFTER):
        stop_after(int(os.environ[STOP_AFTER]))
    if os.environ.get("CLIP_JAX_TESTS_XLA_CACHE"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from train_config import share_compiled_programs_across_ranks

        share_compiled_programs_across_ranks()
    return c


def stop_after(step: int) -> None:
    from clip_jax.training.trainer import Trainer

    original = Trainer._train_step

    def stepping(self, first):
        read = original(self, first)
        if self.step >= step and self.stop is not None and not self.stop.received:
            self.stop.received = "SIGTERM"
        return read

    Trainer._train_step = stepping
