"""Test set-up: eight simulated CPU devices, so sharded code runs as on a GPU node, compiled with LLVM's cheapest code
generation (tests/xla_flags.py); jaxlib's CUDA plugin loads without a GPU, for the deviceless XLA:GPU compiles (and
test subprocesses inherit these settings); a private loopback and a session-wide XLA compilation cache. Also the
tiny models and the random batch the tests share."""

import copy
import json
import os
import shutil
import sys
import tempfile

import private_loopback
import pytest
from xla_flags import xla_flags

# First, while this process has one thread: the multi-process tests' gloo sockets on a loopback that does not stall
# (see private_loopback).
PRIVATE_LOOPBACK = private_loopback.enter()

os.environ.setdefault("XLA_FLAGS", xla_flags(8))  # and the cheapest code generation (tests/xla_flags.py)
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # clip_jax.runtime.xla_gpu.prepare()

# XLA's persistent compilation cache in a folder of this test session's own, shared by the trainer processes the
# tests start and by pytest-xdist's workers (they inherit the environment): a program compiled once, however small,
# is read back by every later test and process that builds the same one. Empty at the start of each session; removed
# at its end by the process that made it.
_INHERITED_CACHE = os.environ.get("CLIP_JAX_TESTS_XLA_CACHE") if "PYTEST_XDIST_WORKER" in os.environ else None
_XLA_CACHE = _INHERITED_CACHE or tempfile.mkdtemp(prefix="clip_jax-tests-xla-cache-")
os.environ["CLIP_JAX_TESTS_XLA_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

# Programs keyed as the trainer processes the tests start key theirs (tests/train_config.py): a run compiled here is
# read back by a trainer process on the same devices with the same config, and the other way round.
from train_config import share_compiled_programs_across_ranks  # noqa: E402

share_compiled_programs_across_ranks()

import tiny_model  # noqa: E402  (imports clip_jax: after the settings above)

# The trainer's tests read Fashion-MNIST shards (28 px images) and tokenize real captions (OpenAI's vocabulary).
TRAINER_MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 28, "patch_size": 7, "width": 32, "layers": 2, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


@pytest.fixture(scope="module")
def tiny_model_config():
    """OpenCLIP's config format for the tiny model; a copy for each test module."""
    return copy.deepcopy(tiny_model.TINY_MODEL)


@pytest.fixture(scope="session")
def random_batch():
    """`random_batch(rows)`: the same random images and tokens for the tiny model on every call."""
    return tiny_model.random_batch


@pytest.fixture(scope="session")
def trainer_model_file(tmp_path_factory):
    """The trainer tests' model as an OpenCLIP .json file, as a run's config names it."""
    path = tmp_path_factory.mktemp("model") / "tiny.json"
    path.write_text(json.dumps(TRAINER_MODEL))
    return str(path)


MARKERS = {
    "slow": "takes more than a few seconds (a training run, a compile of a real-size model, processes): "
            "pytest -m 'not slow' is the everyday loop",
    "subprocess": "starts other processes (the trainer, joined ranks, a command line)",
    "gpu_compile": "compiles for GPUs without one (deviceless XLA:GPU, jaxlib's CUDA plugin)",
}


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_unconfigure(config):
    if not _INHERITED_CACHE:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def fashion_mnist_shards(tmp_path_factory, trainer_model_file):
    """`fashion_mnist_shards(n)`: (the pattern of the first `n` Fashion-MNIST training images, in shards of 256, and
    the trainer tests' model file), as the trainer modules' `shards` fixtures give them. The 2,048 images are written
    once a session; the first n // 256 shards are those `write_shards` makes of the first n images. Read only."""
    from clip_jax.data import make_shards

    folder = str(tmp_path_factory.mktemp("fashion-mnist-train"))
    paths = make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=2048), folder, 256)

    def first(n: int):
        assert n % 256 == 0 and 512 <= n <= 256 * len(paths), n
        return make_shards.shard_pattern(paths[:n // 256]), trainer_model_file

    return first


@pytest.fixture(scope="module")
def orbax_writes_replicated_arrays_whole():
    """For a module whose checkpoints are not about how Orbax splits its writes: an array replicated over the devices
    is written from one of them (Orbax's default where JAX_PLATFORMS names a GPU), not in one slice per device (its
    default otherwise, so here: each slice a program compiled on its own, seconds per save of an 8-device state)."""
    import orbax.checkpoint as ocp

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ocp.type_handlers.get_type_handler(jax.Array), "_use_replica_parallel", False)
        yield


def pytest_report_header(config):
    return f"private loopback with MTU {private_loopback.MTU}: {'yes' if PRIVATE_LOOPBACK else 'no (not permitted)'}"


@pytest.fixture(autouse=True)
def the_process_left_as_found():
    """A test that leaves this process changed for the tests after it in its xdist worker fails here, by name: a
    checkpoint manager left open (a `Trainer` or `RunCheckpoints` used without `with` or `close()`: its threads
    outlive it), a stop-signal handler not restored, a log filter left on absl's or the root logger."""
    import logging
    import signal

    def open_managers() -> int:
        checkpoints = sys.modules.get("clip_jax.runtime.checkpoints")  # not imported: none was opened
        return checkpoints.RunCheckpoints.opened if checkpoints else 0

    def state():
        return ({name: signal.getsignal(name) for name in (signal.SIGINT, signal.SIGTERM)},
                {name: list(logging.getLogger(name).filters) for name in ("absl", "")})

    managers, before = open_managers(), state()
    yield
    left_open = open_managers() - managers
    assert left_open <= 0, f"{left_open} checkpoint manager(s) left open: use the Trainer or RunCheckpoints in `with`"
    handlers, filters = state()
    assert handlers == before[0], f"signal handlers changed: {before[0]} -> {handlers}"
    assert filters == before[1], f"log filters changed: {before[1]} -> {filters}"


@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder this process cannot write into: mode 555, or, for root (whom modes do not stop), sysfs's root."""
    if os.geteuid() == 0:
        return "/sys"
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    return str(folder)
