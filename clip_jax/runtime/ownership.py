"""What clip_jax wrote, so that it never replaces or deletes a file of someone else's.

Every folder clip_jax writes into holds a manifest, `.clip_jax-written` (JSON), naming the entries (files and folders,
one level deep) that clip_jax put there; everything below a recorded folder (a run's `checkpoints/`) is clip_jax's
too. A writer claims the names it is about to write (`claim`): a name that exists and is not in the manifest
belongs to someone else, and the writer refuses with one line naming the files and the setting to change
(`ForeignFiles`). Names are recorded before their files are written, so what a killed writer leaves is still known
as clip_jax's, and a clean-up (`remove`) deletes only what the manifest names.

Names that begin with `.clip_jax` (the manifest, locks, staging folders) are clip_jax's by their name. A run
directory written before manifests existed is recognised by its `config.json` (a clip_jax run config): the entries
a run writes count as clip_jax's there (`clip_jax.runtime.run_layout`, which knows the layout).

Folders may be local or on a bucket (`clip_jax.runtime.storage`). One process writes a folder's manifest at a time: the
shard writers that several processes call hold the folder's lock, and a run's manifest is written by process 0.
"""

import json
import os
from collections.abc import Iterable

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.runtime import run_layout, storage

MANIFEST = ".clip_jax-written"
OWN_PREFIX = ".clip_jax"  # names clip_jax's by their name: the manifest, locks, staging folders
_NAMED_AT_MOST = 5


class ForeignFiles(InvalidInput):
    """Writing would replace files that clip_jax did not write."""


def owned_names(folder: str) -> set[str]:
    """The entries of `folder` that clip_jax wrote (recorded in its manifest, or those of a run directory that
    predates manifests); names beginning with `.clip_jax` are not listed but are clip_jax's too."""
    manifest = storage.join(folder, MANIFEST)
    if storage.isfile(manifest):
        try:
            names = json.loads(storage.read_text(manifest))["names"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidInput(f"{manifest} (clip_jax's record of the files it wrote there) cannot be read: {e}; "
                               "delete it only if nothing in that folder is clip_jax's") from e
        return set(names)
    return set(_older_run_entries(folder))


def foreign_names(folder: str, names: Iterable[str] | None = None) -> list[str]:
    """The entries of `folder` that clip_jax did not write: among `names` those that exist, or all of them."""
    present = storage.listdir(folder)
    if names is not None:
        wanted = set(names)
        present = [name for name in present if name in wanted]
    owned = owned_names(folder) if present else set()
    return sorted(name for name in present if not name.startswith(OWN_PREFIX) and name not in owned)


def refuse_foreign(folder: str, names: Iterable[str] | None = None, *, writing: str, change: str) -> None:
    """Raises `ForeignFiles` when `folder` holds entries clip_jax did not write (among `names`, or any):
    "`writing` would replace N files in FOLDER that clip_jax did not write (...): `change`"."""
    foreign = foreign_names(folder, names)
    if foreign:
        shown = ", ".join(foreign[:_NAMED_AT_MOST]) + (", ..." if len(foreign) > _NAMED_AT_MOST else "")
        count = f"{len(foreign)} file{'s' if len(foreign) > 1 else ''}"
        raise ForeignFiles(f"{writing} would write into {folder}, which holds {count} clip_jax did not write "
                           f"({shown}): {change}")


def record(folder: str, names: Iterable[str]) -> None:
    """Adds `names` to the manifest of `folder` (made when missing): they are clip_jax's from now on."""
    names = {name for name in names if not name.startswith(OWN_PREFIX)}
    manifest = storage.join(folder, MANIFEST)
    recorded = set(json.loads(storage.read_text(manifest))["names"]) if storage.isfile(manifest) else set()
    if not recorded:
        recorded = {name for name in _older_run_entries(folder) if storage.exists(storage.join(folder, name))}
    if names <= recorded and recorded:
        return
    text = json.dumps({"written_by": "clip_jax", "names": sorted(recorded | names)}, indent=1) + "\n"
    if storage.is_remote(folder):
        storage.write_text(manifest, text)  # one object: written whole or not at all
        return
    os.makedirs(folder, exist_ok=True)
    partial = f"{manifest}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, manifest)


def claim(folder: str, names: Iterable[str], *, writing: str, change: str) -> None:
    """Before writing `names` into `folder`: refuses (`refuse_foreign`) if one of them exists and is not clip_jax's,
    else records them."""
    names = list(names)
    refuse_foreign(folder, names, writing=writing, change=change)
    record(folder, names)


def claim_file(path: str, *, writing: str, change: str) -> None:
    """`claim` for one file `path` (an output a command writes, e.g. `--output report.json`), after checking that it
    can be written there (`storage.check_output_file`: one line naming the path, not a failed write later)."""
    storage.check_output_file(path, what=writing, change=change)
    claim(storage.dirname(storage.absolute(path)), [storage.basename(path)], writing=writing, change=change)


def remove(folder: str, name: str) -> None:
    """Deletes entry `name` of `folder` (a folder with all it holds), which must be clip_jax's."""
    if not (name.startswith(OWN_PREFIX) or name in owned_names(folder)):
        raise ForeignFiles(f"{storage.join(folder, name)} was not written by clip_jax: left as it is")
    path = storage.join(folder, name)
    if not storage.exists(path):
        raise MissingInput(f"{path} does not exist")
    from etils import epath

    target = epath.Path(path)
    if target.is_dir():
        target.rmtree()
    else:
        target.unlink()


def _older_run_entries(folder: str) -> tuple[str, ...]:
    """The entries a run writes, when `folder` is a run directory written before manifests; else none."""
    return run_layout.RUN_ENTRIES if run_layout.written_before_manifests(folder) else ()
