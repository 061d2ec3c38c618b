"""A training config for tests that launch the trainer as a process: the fields come as JSON in the environment.

A test seam, since this file runs inside the trainer's process: with CLIP_JAX_TEST_PAUSE_AT=save (or evaluation)
and CLIP_JAX_TEST_PAUSE_FILE=PATH, the trainer's first non-final checkpoint save (or first evaluation) creates PATH
once it has started and waits until the test removes it, so that the test signals the trainer at that moment."""

import json
import os
import time

from clip_jax.run_config import default_config

PAUSE_AT, PAUSE_FILE = "CLIP_JAX_TEST_PAUSE_AT", "CLIP_JAX_TEST_PAUSE_FILE"


def get_config():
    c = default_config()
    for key, value in json.loads(os.environ["CLIP_JAX_TEST_CONFIG"]).items():
        c[key] = tuple(value) if isinstance(value, list) else value
    if os.environ.get(PAUSE_AT):
        pause_once_at(os.environ[PAUSE_AT], os.environ[PAUSE_FILE])
    return c


def pause_once_at(moment: str, path: str) -> None:
    from clip_jax.runtime.checkpoints import RunCheckpoints
    from clip_jax.training.evaluations import Evaluations

    cls, name = {"save": (RunCheckpoints, "save"), "evaluation": (Evaluations, "run")}[moment]
    original, paused = getattr(cls, name), []

    def pausing(self, *args, **kwargs):
        if moment == "save":  # the save is under way (written in the background) while the trainer waits
            result = original(self, *args, **kwargs)
        if not paused and not kwargs.get("force"):
            paused.append(True)
            open(path, "w").close()
            deadline = time.time() + 120
            while os.path.exists(path) and time.time() < deadline:
                time.sleep(0.02)
        return result if moment == "save" else original(self, *args, **kwargs)

    setattr(cls, name, pausing)
