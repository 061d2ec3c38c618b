"""Run directories on local disk or on object storage (`s3://bucket/prefix`, `gs://bucket/prefix`).

Paths are strings throughout clip_jax; the helpers here take either kind and go through `etils.epath` (fsspec's
`s3fs` / `gcsfs` for URLs), so local behaviour is exactly `os`'s. Object stores differ from a disk in two ways that
matter to a run:

- no atomic rename: a checkpoint on a bucket is complete when its `commit_success.txt` exists (Orbax's commit-file
  scheme, `checkpoint_temporary_path_class`), not when a temporary folder was renamed;
- no append: files the trainer appends to or keeps open (metrics.jsonl, TensorBoard events, W&B files) are written
  in a local staging folder and uploaded whole (`StagedOutputs`).

Requests that fail now and then (a 500 or 503 answer, a cut connection, a slow one) are retried by each client with
the same number of attempts (`retry_attempts`, `CLIP_JAX_STORAGE_RETRIES`): botocore (s3fs) and TensorStore, with
exponential backoff; what fails after them stops the run (`clip_jax.runtime.storage_faults`).

Array data goes through TensorStore. Orbax 0.12.8 hands it only `gs://` URLs natively; `enable_orbax_s3` teaches
Orbax's spec builder to hand it `s3://` ones too, with the endpoint and region of the AWS environment variables.
"""

import os
import posixpath
import shutil
import tempfile
from urllib.parse import urlparse

from etils import epath

from clip_jax.errors import InvalidInput, MissingInput, RunFailed, require_extra
from clip_jax.runtime import private_apis

REMOTE_SCHEMES = ("s3", "gs")
_PACKAGES = {"s3": "s3fs", "gs": "gcsfs"}
COMMIT_FILE = "commit_success.txt"  # Orbax's marker of a committed step under the commit-file scheme
RETRIES_VARIABLE, DEFAULT_RETRIES = "CLIP_JAX_STORAGE_RETRIES", 8
# TensorStore's backoff between attempts (botocore's standard mode has its own: random, up to 2^attempt s, max 20 s)
_FIRST_DELAY, _MAX_DELAY = "0.5s", "16s"


def scheme(path: str) -> str:
    """The URL scheme of `path` ("" for a local path)."""
    text = str(path)
    return text.split("://", 1)[0] if "://" in text else ""


def is_remote(path: str) -> bool:
    return scheme(path) in REMOTE_SCHEMES


def scheme_problem(path: str) -> str | None:
    """Why `path` cannot be a run directory: a URL of a scheme other than s3:// and gs://; None when it can."""
    kind = scheme(path)
    if kind and kind not in REMOTE_SCHEMES:
        return (f"{path!r}: {kind}:// is not a run-directory location; give a local path, s3://bucket/prefix or "
                "gs://bucket/prefix")
    return None


def join(base: str, *parts: str) -> str:
    return posixpath.join(str(base), *parts) if is_remote(base) else os.path.join(base, *parts)


def absolute(path: str) -> str:
    """A local path made absolute; a URL without its trailing slashes."""
    if is_remote(path):
        kind, rest = str(path).split("://", 1)
        return f"{kind}://" + posixpath.normpath("/" + rest).lstrip("/")
    return os.path.abspath(path)


def basename(path: str) -> str:
    return posixpath.basename(absolute(path)) if is_remote(path) else os.path.basename(os.path.normpath(path))


def dirname(path: str) -> str:
    return posixpath.dirname(absolute(path)) if is_remote(path) else os.path.dirname(path)


def retry_attempts() -> int:
    """How many times each request to a bucket is tried before it counts as failed: `CLIP_JAX_STORAGE_RETRIES`
    (default 8)."""
    value = os.environ.get(RETRIES_VARIABLE, "").strip() or str(DEFAULT_RETRIES)
    if not value.isdigit() or int(value) < 1:
        raise InvalidInput(f"{RETRIES_VARIABLE}={value!r}: give the number of attempts per request, at least 1")
    return int(value)


def use_fsspec_for_urls(path: str) -> None:
    """Makes `etils.epath` (ours and Orbax's) reach s3:// and gs:// through fsspec (s3fs, gcsfs). Where TensorFlow
    is importable epath would pick `tf.io.gfile` instead, which has no S3 filesystem; set once a remote run
    directory is used, so that local runs leave epath's choice alone. s3fs gets the run's retries (`retry_attempts`)
    before its first filesystem object is made."""
    if is_remote(path):
        os.environ.setdefault("EPATH_USE_TF", "false")
    if scheme(path) == "s3":
        _retry_s3_requests()


def _retry_s3_requests() -> None:
    """fsspec's defaults for every s3fs filesystem made from here on: botocore's standard retry mode (500, 503,
    throttling, connection errors) with `retry_attempts()` attempts. s3fs keeps its own few retries around them
    (of throttling answers and of a body cut off while it was read). A filesystem already made keeps its settings."""
    import fsspec.config

    retries = {"max_attempts": retry_attempts(), "mode": "standard"}
    fsspec.config.conf.setdefault("s3", {}).setdefault("config_kwargs", {"retries": retries})


def _forget_listings(path: str) -> None:
    """Drops fsspec's cached bucket listings, so a question about `path` goes to the store: other processes, and
    TensorStore, write there without this process's filesystem object seeing it."""
    if is_remote(path):
        use_fsspec_for_urls(path)
        from etils.epath import backend

        backend.fsspec_backend.fs(path).invalidate_cache()


def exists(path: str) -> bool:
    _forget_listings(path)
    return epath.Path(path).exists()


def isdir(path: str) -> bool:
    _forget_listings(path)
    return epath.Path(path).is_dir()


def isfile(path: str) -> bool:
    _forget_listings(path)
    return epath.Path(path).is_file()


def listdir(path: str) -> list[str]:
    """Names in folder `path`, [] when there is none (a bucket has no empty folders)."""
    _forget_listings(path)
    folder = epath.Path(path)
    if not folder.is_dir():
        return []
    return sorted(child.name for child in folder.iterdir())


def read_text(path: str) -> str:
    use_fsspec_for_urls(path)
    return epath.Path(path).read_text()


def write_text(path: str, text: str) -> None:
    """Writes a whole file (on a bucket: one object), making the folders a disk needs."""
    use_fsspec_for_urls(path)
    target = epath.Path(path)
    if not is_remote(path):
        target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def write_bytes(path: str, data: bytes) -> None:
    """Writes a whole file (on a bucket: one object, which appears only once complete), making the folders a disk
    needs."""
    use_fsspec_for_urls(path)
    target = epath.Path(path)
    if not is_remote(path):
        target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def open_file(path: str, mode: str = "r"):
    use_fsspec_for_urls(path)
    return epath.Path(path).open(mode)


def upload(local: str, remote: str) -> None:
    """Copies local file `local` to `remote` (a whole object)."""
    use_fsspec_for_urls(remote)
    epath.Path(local).copy(epath.Path(remote), overwrite=True)


# -- checks before a run builds anything ------------------------------------------------------------------------

def _filesystem(kind: str):
    """The fsspec filesystem of `kind`, or a one-line MissingExtra naming the package to install."""
    require_extra(_PACKAGES[kind], "remote", f"a {kind}:// run directory")
    import fsspec

    if kind == "s3":  # fail fast on an unreachable endpoint instead of botocore's minutes of retries
        return fsspec.filesystem("s3", skip_instance_cache=True,
                                 config_kwargs={"connect_timeout": 5, "read_timeout": 20,
                                                "retries": {"max_attempts": 1}})
    return fsspec.filesystem(kind, skip_instance_cache=True)


def unwritable(path: str, *, probe: str = ".clip_jax_write_probe") -> str | None:
    """Why files cannot be written under the local folder `path`, or None when they can. The test is a real write:
    a new empty file (`probe`-XXXX, never one that exists) made and deleted in `path`, or in its nearest existing
    parent when `path` is still to be made, so that nothing is left behind, no folder either."""
    folder = os.path.abspath(path)
    while not os.path.lexists(folder):  # "/" exists
        folder = os.path.dirname(folder)
    try:
        handle, name = tempfile.mkstemp(prefix=f"{probe}-", dir=folder)
    except OSError as e:
        return f"{folder} is not writable ({e.strerror})" if os.path.isdir(folder) else f"{folder} is not a folder"
    os.close(handle)
    os.remove(name)
    return None


def check_output_folder(path: str, *, what: str, change: str, remote: bool = True,
                        probe: str = ".clip_jax_write_probe") -> None:
    """Before any work: a one-line UserError when `what` ("the export", "the run directory") cannot be written into
    the folder `path` (made when missing): "cannot write WHAT PATH: REASON; CHANGE". On disk the test is a real
    write (`unwritable`); on a bucket, credentials, bucket, endpoint and the right to write (`check_location`);
    with `remote` False (a command that writes local files only) a URL is refused. `probe` names the test file (one
    name per process where several check at once)."""
    _check_output(path, path, what=what, change=change, remote=remote, probe=probe)


def check_output_file(path: str, *, what: str, change: str, remote: bool = True) -> None:
    """`check_output_folder` for one file `path` a command writes (`--output report.json`): its folder, and the
    path itself where something is there already (a folder, or a file that cannot be written)."""
    if not is_remote(path) and os.path.lexists(path):
        reason = (f"{absolute(path)} is a folder" if os.path.isdir(path) else
                  None if os.access(path, os.W_OK) else f"{absolute(path)} is not writable")
        if reason:
            raise InvalidInput(f"cannot write {what} {absolute(path)}: {reason}; {change}")
    _check_output(path, dirname(absolute(path)), what=what, change=change, remote=remote)


def _check_output(named: str, folder: str, *, what: str, change: str, remote: bool,
                  probe: str = ".clip_jax_write_probe") -> None:
    """`check_output_folder` of `folder`, the error naming `named` (the output: that folder or a file in it)."""
    if not is_remote(named):
        reason = unwritable(folder, probe=probe)
        if reason:
            raise InvalidInput(f"cannot write {what} {absolute(named)}: {reason}; {change}")
    elif not remote:
        raise InvalidInput(f"cannot write {what} to {named}: it is written to a local path only (copy it to "
                           f"the bucket afterwards); {change}")
    else:
        check_location(folder, write=True, probe=probe)


def check_location(url: str, *, write: bool, probe: str = ".clip_jax_write_probe") -> None:
    """Raises a one-line UserError when the run cannot use `url`: the s3fs/gcsfs package missing, no credentials,
    a bucket that does not exist, an endpoint that does not answer, (with `write`) no right to write there.
    `write` puts and deletes a small object `probe` under the prefix (one name per process: several check at once);
    otherwise the prefix is looked up (not the bucket's root, which a prefix-scoped policy may not let one list)."""
    kind = scheme(url)
    if kind not in REMOTE_SCHEMES:
        return
    parsed = urlparse(url)
    bucket = parsed.netloc
    if not bucket:
        raise InvalidInput(f"{url!r} names no bucket: give {kind}://bucket/prefix")
    fs = _filesystem(kind)
    where = f"{kind}://{bucket}"
    hint = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a non-AWS store)" if kind == "s3"
            else "set GOOGLE_APPLICATION_CREDENTIALS or run gcloud auth application-default login")
    missing_bucket = f"bucket {where} (of {url}) does not exist: create it, or fix the URL"
    try:
        if write:  # proves the bucket, the credentials and the right to write
            key = f"{absolute(url)}/{probe}".split("://", 1)[1]
            fs.pipe_file(key, b"")
            fs.rm_file(key)
        elif not fs.exists(absolute(url).split("://", 1)[1]):
            raise MissingInput(f"{url} does not exist (or bucket {where} does not): fix the URL")
    except MissingInput:
        raise
    except FileNotFoundError as e:
        raise MissingInput(missing_bucket) from e
    except PermissionError as e:
        raise RunFailed(f"{url}: access denied ({_first_line(e)}); {hint}") from e
    except Exception as e:  # noqa: BLE001  botocore/aiohttp/google errors have no common base worth importing
        name = type(e).__name__
        if "Credential" in name or "credential" in str(e).lower():
            raise RunFailed(f"{url}: no usable credentials ({_first_line(e)}); {hint}") from e
        if "Connect" in name or "Endpoint" in name or isinstance(e, (OSError, TimeoutError)):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default"
            raise RunFailed(f"{url}: cannot reach the storage endpoint ({endpoint}): {_first_line(e)}; check "
                            "AWS_ENDPOINT_URL and the network" if kind == "s3" else
                            f"{url}: cannot reach the storage service: {_first_line(e)}") from e
        raise RunFailed(f"{url}: cannot use this location: {name}: {_first_line(e)}") from e


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# -- Orbax on object storage ------------------------------------------------------------------------------------

def checkpoint_temporary_path_class(directory: str):
    """Orbax's commit scheme for `directory`: the commit file on a bucket (no atomic rename there), None (Orbax's
    default, a temporary folder renamed when complete) on disk."""
    if not is_remote(directory):
        return None
    return private_apis.orbax_commit_file_path_class()


def s3_kvstore_spec(url: str) -> dict:
    """TensorStore's spec of the `s3://bucket/prefix/` key-value store, with the endpoint and region the AWS
    environment variables name (TensorStore does not read AWS_ENDPOINT_URL itself), the run's retries, and the
    credentials of AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY where they are set."""
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    retries = {"max_retries": retry_attempts(), "initial_delay": _FIRST_DELAY, "max_delay": _MAX_DELAY}
    spec = {"driver": "s3", "bucket": bucket, "path": prefix.strip("/") + "/",
            "context": {"s3_request_retries": retries}}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # the keys the default chain would take first, without its complaints
        spec["aws_credentials"] = {"type": "environment"}  # about absent ~/.aws files on every save
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    return spec


_ORBAX_S3 = False


def prepare_for_orbax(directory: str) -> None:
    """What Orbax needs before it reads or writes under `directory`: epath on fsspec for URLs, and for s3://
    TensorStore specs it can build (`enable_orbax_s3`). Nothing for a local path."""
    use_fsspec_for_urls(directory)
    if scheme(directory) == "s3":
        enable_orbax_s3()


def enable_orbax_s3() -> None:
    """Lets Orbax write and read array data at `s3://` URLs through TensorStore's s3 driver (Orbax 0.12.8 builds
    such specs for `gs://` only, and would treat `s3://...` as a relative local path; `private_apis.route_orbax_s3`).
    Done once per process; `gs://` and local paths keep Orbax's own handling."""
    global _ORBAX_S3
    if _ORBAX_S3:
        return
    private_apis.route_orbax_s3(s3_kvstore_spec, absolute)
    _ORBAX_S3 = True


# -- files the trainer appends to ----------------------------------------------------------------------------

class StagedOutputs:
    """The run's appended and kept-open files (metrics.jsonl, TensorBoard events, W&B files) on a local disk.

    For a local run directory that is the run directory itself, and `sync` does nothing. For a bucket it is a
    staging folder (under $TMPDIR) whose files `sync` uploads whole when they changed: the trainer syncs at every
    checkpoint save and at exit, so a crash loses at most the metrics written since the last save. The run's
    earlier appended files (`carried`: its metrics and W&B run id) are downloaded first, so a resumed run appends to
    its own history."""

    def __init__(self, run_dir: str, carried: tuple[str, ...] = ()):
        self.run_dir = run_dir
        self.remote = is_remote(run_dir)
        self._uploaded: dict[str, tuple[int, int]] = {}
        if not self.remote:
            self.local_dir = run_dir
            return
        self.local_dir = tempfile.mkdtemp(prefix="clip_jax-run-")
        for name in carried:
            source = join(run_dir, name)
            if isfile(source):
                with open(os.path.join(self.local_dir, name), "w") as f:
                    f.write(read_text(source))
                self._uploaded[name] = self._signature(name)

    def path(self, name: str) -> str:
        """Where the trainer writes `name` (relative to the run directory)."""
        return os.path.join(self.local_dir, name)

    def _signature(self, relative: str) -> tuple[int, int]:
        status = os.stat(os.path.join(self.local_dir, relative))
        return status.st_size, status.st_mtime_ns

    def sync(self) -> list[str]:
        """Uploads the staged files that changed since their last upload; returns their relative paths."""
        if not self.remote:
            return []
        sent = []
        for root, _, files in os.walk(self.local_dir):
            for name in files:
                relative = os.path.relpath(os.path.join(root, name), self.local_dir)
                signature = self._signature(relative)
                if self._uploaded.get(relative) == signature:
                    continue
                upload(os.path.join(self.local_dir, relative), join(self.run_dir, *relative.split(os.sep)))
                self._uploaded[relative] = signature
                sent.append(relative)
        return sent

    def close(self) -> None:
        """Last upload, then the staging folder goes (kept, and named, when the upload fails)."""
        if not self.remote:
            return
        try:
            self.sync()
        except Exception as e:
            raise RunFailed(f"could not upload the run's metrics to {self.run_dir} ({_first_line(e)}); they are "
                            f"kept in {self.local_dir}") from e
        shutil.rmtree(self.local_dir, ignore_errors=True)
