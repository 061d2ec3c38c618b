"""A run's own copy of its tokenizer: a model read by a folder's SentencePiece tokenizer (a SigLIP model's: the
folder `--config.tokenizer` or the pretrained folder names) has that folder's tokenizer files copied into the run
directory's `tokenizer/` at its start, so the run is whole without the folder (`clip_jax.interop.opener` reads a
run's tokenizer from there). A resume whose config reads another tokenizer (other files, or a model's own BPE) is
refused in one line before anything is built; a fresh start in the same directory replaces the copy (clip_jax's).
"""

import os
import shutil

from clip_jax.errors import InvalidInput
from clip_jax.text.model_tokenizer import tokenizer_file_names
from clip_jax.runtime import ownership, storage
from clip_jax.runtime.run_directory import RunDirectory
from clip_jax.runtime.run_layout import TOKENIZER


def _read_files(folder: str, names) -> dict[str, bytes]:
    files = {}
    for name in names:
        with storage.open_file(storage.join(folder, name), "rb") as f:
            files[name] = f.read()
    return files


def _named_files(folder: str) -> dict[str, bytes]:
    """The files of the tokenizer in `folder`."""
    return _read_files(folder, tokenizer_file_names(folder))


def _kept_files(kept: str) -> dict[str, bytes]:
    """The files of the run's copy."""
    return _read_files(kept, storage.listdir(kept))


def check_run_tokenizer(directory: RunDirectory, folder: str | None, *, resuming: bool) -> None:
    """Refuses, in one line, a resume of the run in `directory` whose model reads another tokenizer than the copy
    the run kept: `folder`'s files are not those, or `folder` is None (the model's own vocabulary)."""
    kept = directory.join(TOKENIZER)
    if not resuming or not storage.isdir(kept):
        return
    if folder is not None and _named_files(folder) == _kept_files(kept):
        return
    reads = f"the tokenizer in {folder}, another one" if folder else "the model config's own tokenizer"
    raise InvalidInput(f"the run {directory.path} was trained with the tokenizer kept in {kept}, and this start reads "
                       f"{reads}: resume with --config.tokenizer={kept}, or start another run with --config.name")


def keep_run_tokenizer(directory: RunDirectory, folder: str | None) -> None:
    """Copies the files of the tokenizer in `folder` into `directory`'s `tokenizer/` (already recorded as the
    run's) unless that holds them; a copy that differs, or any when `folder` is None, is removed first
    (`check_run_tokenizer` lets only a fresh start get here with one)."""
    kept = directory.join(TOKENIZER)
    files = _named_files(folder) if folder is not None else None
    if storage.isdir(kept):
        if _kept_files(kept) == files:
            return
        ownership.remove(directory.path, TOKENIZER)  # a fresh start's: the run's earlier start kept another
    if files is None:
        return
    local = not storage.is_remote(kept)  # on a disk, the copy appears whole: written aside, then renamed
    staging = directory.join(f"{ownership.OWN_PREFIX}-partial-{TOKENIZER}") if local else kept
    if local and os.path.isdir(staging):
        shutil.rmtree(staging)  # a copy a killed start left
    for name, data in files.items():
        storage.write_bytes(storage.join(staging, name), data)
    if local:
        os.rename(staging, kept)
