"""Writing `python -m clip_jax.embed`'s output: one part's files, each whole or not at all, and the folder's record.

A part is `img_emb/img_emb_N.npy` and `text_emb/text_emb_N.npy` (float16 [n, E]) and `metadata/metadata_N.parquet`
(`image_path`, `caption`, then the fields of the samples' `.json`, nested ones as `a.b`), row for row. Each file is
written under a staging name beside it and renamed into place (on a bucket, `s3://` or `gs://`: written as one object,
which appears only once complete), so a killed run leaves no file that looks complete; the metadata goes last, so
a part is done once its parquet file is there with its embeddings.

The folder's record, `.clip_jax-embed.json`, says which model (a digest of its weights) and which settings wrote
the parts: a run continues a folder only with the same ones, and refuses a folder holding another model's
embeddings. The folder's entries are claimed through `clip_jax.runtime.ownership` before anything is written.
"""

import hashlib
import io
import json
import os
from collections.abc import Sequence

import jax
import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.evaluation.embed_parts import KINDS
from clip_jax.runtime import ownership, stop_signals, storage

RECORD = ".clip_jax-embed.json"
_STAGING = ".clip_jax-partial-"
_CHANGE = "give another --output_folder"
_SKIPPED_KEYS = {"image_path", "caption", "metadata"}  # the .json may not replace the columns clip-retrieval sets


def weights_digest(params) -> str:
    """SHA-256 of every leaf's name, shape, dtype and bytes: two models agree only when their weights do."""
    digest = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda item: jax.tree_util.keystr(
            item[0])):
        leaf = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode())
        digest.update(leaf.data)
    return digest.hexdigest()


def check_output(output_folder: str, record: dict) -> None:
    """Refuses an `output_folder` whose entries are not clip_jax's, or whose earlier parts are of another model
    or were made with other settings. Every process checks before any writes, so all refuse alike."""
    if storage.isdir(output_folder):
        ownership.refuse_foreign(output_folder, list(KINDS) + [RECORD], writing="python -m clip_jax.embed",
                                 change=_CHANGE)
    path = storage.join(output_folder, RECORD)
    if storage.isfile(path):
        try:
            earlier = json.loads(storage.read_text(path))
        except (OSError, ValueError) as e:
            raise InvalidInput(f"{path} (the record of the embeddings there) cannot be read: {e}; {_CHANGE}") from e
        if earlier.get("weights") != record["weights"]:
            raise InvalidInput(f"{output_folder} holds the embeddings of another model ({earlier.get('clip_model')}, "
                               f"other weights than {record['clip_model']}): {_CHANGE}")
        differ = [key for key in record if key != "clip_model" and earlier.get(key) != record[key]]
        if differ:
            raise InvalidInput(f"{output_folder} holds embeddings made with other settings ("
                               + ", ".join(f"{key} {earlier.get(key)!r}, now {record[key]!r}" for key in differ)
                               + f"): run with the same ones to continue it, or {_CHANGE}")


def claim_output(output_folder: str, record: dict) -> None:
    """Records the folder's entries as clip_jax's, and the run (one process, once every process checked)."""
    ownership.claim(output_folder, list(KINDS) + [RECORD], writing="python -m clip_jax.embed", change=_CHANGE)
    _replace(storage.join(output_folder, RECORD), (json.dumps(record, indent=1) + "\n").encode())


def _replace(path: str, data: bytes) -> None:
    """Writes `path` whole or not at all: staged beside it, then renamed over it; on a bucket, one object."""
    if storage.is_remote(path):
        storage.write_bytes(path, data)
        return
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    for left in os.listdir(folder):  # what a killed run was writing under this name
        if left.startswith(f"{_STAGING}{name}."):
            os.remove(os.path.join(folder, left))
    staging = os.path.join(folder, f"{_STAGING}{name}.{os.getpid()}")
    with stop_signals.unfinished(staging):  # removed if the command is stopped before it is in place
        with open(staging, "wb") as f:
            f.write(data)
        stop_signals.reached("write")
        os.replace(staging, path)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _flat(fields: dict, prefix: str = "") -> dict:
    """Nested objects of a sample's .json as `a.b` columns."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _column(values: list):
    """A parquet column of the values; values of mixed types become their JSON text."""
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values])


def metadata_table(image_paths: Sequence[str] | None, captions: Sequence[str] | None,
                   metadata: Sequence[bytes | None] | None):
    """clip-retrieval's metadata columns: `image_path`, `caption`, then the .json fields in the order first seen."""
    import pyarrow as pa

    columns = {}
    if image_paths is not None:
        columns["image_path"] = pa.array(list(image_paths), pa.string())
    if captions is not None:
        columns["caption"] = pa.array(list(captions), pa.string())
    if metadata is not None:
        rows = [_parsed(raw) for raw in metadata]
        names = list(dict.fromkeys(name for row in rows for name in row if name not in _SKIPPED_KEYS))
        for name in names:
            columns[name] = _column([row.get(name) for row in rows])
    return pa.table(columns)


def _parsed(raw: bytes | None) -> dict:
    try:
        fields = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return _flat(fields) if isinstance(fields, dict) else {}


def write_part(paths: dict[str, str], *, image_embeddings: np.ndarray | None, text_embeddings: np.ndarray | None,
               table) -> None:
    """Writes one part: the embeddings as float16, then its metadata (the file that marks the part done)."""
    import pyarrow.parquet as pq

    for kind, embeddings in (("img_emb", image_embeddings), ("text_emb", text_embeddings)):
        if kind in paths:
            _replace(paths[kind], _npy(np.asarray(embeddings, np.float16)))
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    _replace(paths["metadata"], buffer.getvalue())
