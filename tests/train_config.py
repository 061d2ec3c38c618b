"""A training config for tests that launch the trainer as a process: the fields come as JSON in the environment."""

import json
import os

from clip_jax.run_config import default_config


def get_config():
    c = default_config()
    for key, value in json.loads(os.environ["CLIP_JAX_TEST_CONFIG"]).items():
        c[key] = tuple(value) if isinstance(value, list) else value
    return c
