"""The internals of other packages that clip_jax relies on, in one place: what their public API does not offer.

- jax: the coordination service's barrier (`wait_at_barrier`), which the ranks of a CPU run meet at once compiled;
  its compiler module, on the stack while an XLA program compiles (`jax_compiling`, `at_each_compile`).
- orbax-checkpoint: the commit-file scheme of checkpoints on a bucket (`orbax_commit_file_path_class`), and its
  TensorStore spec builders, taught `s3://` (`route_orbax_s3`).
- grain: the shared memory of dropped batches, freed before the process exits
  (`finish_grain_shared_memory_deletes`), and the absl flag its worker start reads (`let_grain_start_workers`).

Such internals change without notice between releases. Importing this module checks the installed versions against
those the code here was written for (`WRITTEN_FOR`) and fails with one line naming the package, the version found
and the range (`IncompatibleVersion`); a package that is not installed is not checked (what needs it says so when
used). Nothing else happens at import: each function imports its package when called.
"""

import importlib.metadata
import os
import re
from collections.abc import Callable, Mapping

from clip_jax.errors import RunFailed, UserError

# distribution -> (the oldest version, the first version not covered): the versions these internals were read in.
# jax 0.11: its source (0.11.1) keeps the barrier as 0.10 has it, `global_state.client.wait_at_barrier(barrier_id,
# timeout_in_ms)`; the GPU image clip_jax was measured on runs 0.11.2.
WRITTEN_FOR = {"jax": ("0.10.2", "0.12"), "orbax-checkpoint": ("0.12.8", "0.13"), "grain": ("0.2.18", "0.3")}


class IncompatibleVersion(UserError, ImportError):
    """An installed package is outside the versions whose internals clip_jax was written for."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.12.8" -> (0, 12, 8), "0.13.0rc1" -> (0, 13, 0)."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split("+")[0].split("."))


def check_versions(installed: Mapping[str, str]) -> None:
    """Raises `IncompatibleVersion` for the first package of `installed` ({distribution: version}) outside the range
    `WRITTEN_FOR` gives it; packages it does not name are not checked."""
    for name, (oldest, first_not) in WRITTEN_FOR.items():
        if name not in installed:
            continue
        if not release(oldest) <= release(installed[name]) < release(first_not):
            span = f">={oldest},<{first_not}"
            raise IncompatibleVersion(f"{name} {installed[name]} is installed, but clip_jax relies on internals of "
                                      f"{name} {span}: pip install '{name}{span}'")


def installed_versions() -> dict[str, str]:
    """{distribution: version} of the packages `WRITTEN_FOR` names that are installed."""
    found = {}
    for name in WRITTEN_FOR:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


check_versions(installed_versions())


# -- jax ------------------------------------------------------------------------------------------------------

def wait_at_barrier(name: str, timeout_seconds: int) -> None:
    """Waits until every process of the run has reached the barrier `name` (a name new for each barrier), at most
    `timeout_seconds`; through the coordination service's client, as Orbax's barriers use it."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=timeout_seconds * 1000)


# -- orbax-checkpoint -----------------------------------------------------------------------------------------

JAX_COMPILER = ("jax", "_src", "compiler.py")  # the module that compiles (and caches) every XLA program


def jax_compiling(frame) -> bool:
    """Whether `frame` (a thread's current frame) runs inside JAX's compiler module: that thread is compiling an
    XLA program, and holds no Python lock once in the compiler's native code, where it may stay for minutes."""
    while frame is not None:
        if tuple(frame.f_code.co_filename.split(os.sep)[-3:]) == JAX_COMPILER:
            return True
        frame = frame.f_back
    return False


def at_each_compile(moment: Callable[[], None]) -> None:
    """Calls `moment()` as each XLA compile begins, inside JAX's compiler module (a test seam's hook)."""
    from jax._src import compiler

    compile_and_load = compiler.backend_compile_and_load

    def announced(*args, **kwargs):
        moment()
        return compile_and_load(*args, **kwargs)

    compiler.backend_compile_and_load = announced


def orbax_commit_file_path_class():
    """Orbax's temporary-path class that writes a step in place and marks it complete with a commit file last (no
    atomic rename on a bucket)."""
    from orbax.checkpoint._src.path import atomicity

    return atomicity.CommitFileTemporaryPath


def route_orbax_s3(s3_spec: Callable[[str], dict], absolute: Callable[[str], str]) -> None:
    """Lets Orbax write and read array data at `s3://` URLs through TensorStore's s3 driver: its spec builders
    (which know `gs://` only, and would treat `s3://...` as a relative local path) are wrapped so that an `s3://`
    path is kept as `absolute(path)` and its key-value store is `s3_spec(path)`; `gs://` and local paths keep Orbax's
    own handling. Call it once per process."""
    try:
        from orbax.checkpoint._src.path import gcs_utils
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

        normalize, use_remote_driver, kvstore_for = (ts_utils._normalize_path, ts_utils._use_gcs_driver,
                                                     gcs_utils.get_kvstore_for_gcs)
    except (ImportError, AttributeError) as e:
        import orbax.checkpoint

        raise RunFailed(f"s3:// checkpoints rely on the TensorStore spec builder of orbax-checkpoint 0.12; this is "
                        f"{getattr(orbax.checkpoint, '__version__', 'another version')}, which lacks it ({e}): "
                        "install orbax-checkpoint 0.12.x, or use gs:// or a mounted bucket") from e

    def normalize_path(path):
        if str(path).startswith("s3://"):
            return absolute(str(path))
        return normalize(path)

    def use_driver(directory):
        return str(directory).startswith("s3://") or use_remote_driver(directory)

    def kvstore(path, *args, **kwargs):
        if str(path).startswith("s3://"):
            return s3_spec(str(path))
        return kvstore_for(path, *args, **kwargs)

    ts_utils._normalize_path, ts_utils._use_gcs_driver, gcs_utils.get_kvstore_for_gcs = (normalize_path, use_driver,
                                                                                          kvstore)


# -- grain ----------------------------------------------------------------------------------------------------

GRAIN_WORKER_FLAGS = ("grain_enable_multiprocess_worker_profiling",)  # read as Grain starts its worker processes


def let_grain_start_workers() -> None:
    """Grain reads its absl flags in `GRAIN_WORKER_FLAGS` as it starts worker processes; outside `absl.app.run` (a
    script, a test) no flag is parsed and the read raises. Marks those flags as given, at the values they hold (their
    defaults, unless set), as Grain itself does for the flags it hands its workers; absl's other flags, and a
    command's parsed flags, are left as they are."""
    from absl import flags

    for name in GRAIN_WORKER_FLAGS:
        if name in flags.FLAGS and not flags.FLAGS.is_parsed():
            flags.FLAGS[name].present = max(flags.FLAGS[name].present, 1)


def finish_grain_shared_memory_deletes() -> None:
    """Waits for the shared memory of dropped batches to be freed. Grain frees a batch's shared memory in a thread
    pool when the batch is deleted; a process that exits right after stops the pool with its queue unfinished, and
    what was queued is left to the resource tracker ("leaked shared_memory objects") at the end of every run.
    Later deletes free synchronously, or in a new pool when workers start again."""
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    pool = SharedMemoryArray._del_thread_pool
    if pool is not None:
        SharedMemoryArray._disable_async_del()
        pool.close()
        pool.join()
