"""What a shard pattern finds when it is not shards, said in one line before anything is built.

A pattern that names no existing file is told by what its local folder holds (`no_shard_found`): nothing, loose
images (which ``python -m clip_jax.data.make_shards folder`` writes into shards), or ``.tar`` files under other
names than the pattern's. A pattern whose files exist but are images or other archives (loose JPEGs named by a
brace range, .tar.gz files) is caught by reading the first block of each source's first shard (`refuse_non_tar`),
not after the set-up and the compile, shard after shard; a damaged tar is left to the pipeline, which skips it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from clip_jax.data import tar_format
from clip_jax.data.webdataset import open_shard
from clip_jax.errors import InvalidInput

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
# The first bytes of files given as shards by mistake, and what they are
_IMAGES = ((b"\xff\xd8\xff", "a JPEG image"), (b"\x89PNG", "a PNG image"), (b"RIFF", "a WebP image"))
_OTHERS = ((b"\x1f\x8b", "gzip-compressed: a .tar.gz? clip_jax reads uncompressed .tar shards, gunzip it"),
           (b"PK\x03\x04", "a zip archive"))


def _make_shards(folder: str) -> str:
    return (f"write shards from the images with `python -m clip_jax.data.make_shards folder --images {folder} "
            "--out SHARDS` and train on the pattern it prints")


def folder_finding(folder: str) -> str | None:
    """What the local `folder` holds, said for a pattern that found no shard in it; None when it holds none of
    what this can name (nothing, images, .tar files)."""
    names = sorted(os.listdir(folder))
    if not names:
        return (f"{folder} is an empty folder: train_data names webdataset .tar shards (`python -m "
                "clip_jax.data.make_shards` writes them)")
    tars = [name for name in names if name.endswith(".tar")]
    if tars:
        shown = ", ".join(tars[:3]) + (", ..." if len(tars) > 3 else "")
        return (f"{folder} holds {len(tars)} .tar files under other names ({shown}): name those, e.g. "
                f"'{os.path.join(folder, '*.tar')}'")
    images = sum(name.lower().endswith(IMAGE_SUFFIXES) for _, _, files in os.walk(folder) for name in files)
    if images:
        return (f"{folder} holds {images} image files and no .tar shard: train_data names webdataset .tar shards; "
                + _make_shards(folder))
    return None


def no_shard_found(source: str, names: Sequence[str], expanded: int) -> str:
    """The line for a pattern `source` that finds no file: what its one local folder holds when that says why
    (`names`: the source with its braces expanded, a folder or the paths in one), else the names it tried."""
    local = [name.removeprefix("file://") for name in names if "://" not in name or name.startswith("file://")]
    folders = {os.path.normpath(name if os.path.isdir(name) else os.path.dirname(name) or ".") for name in local}
    if len(local) == len(names) and len(folders) == 1 and os.path.isdir(next(iter(folders))):
        finding = folder_finding(next(iter(folders)))
        if finding:
            return f"shard pattern {source!r} matches no file ({expanded} names after expansion): {finding}"
    return (f"shard pattern {source!r} matches no file ({expanded} names after expansion, none exists); "
            "check the path, the brace range, and that the fsspec filesystem for the URL scheme is installed")


def _head(url: str) -> bytes:
    """The first tar block of `url` (fewer bytes when the file is shorter)."""
    with open_shard(url) as f:
        return f.read(tar_format.BLOCK)


def not_a_tar(head: bytes) -> str | None:
    """What a file that starts with `head` (its first block) is instead of a tar file, when its first bytes say so
    (an image, a gzip or zip archive); else None: a tar file, or one the pipeline tells shard by shard as damaged."""
    if tar_format.is_tar_start(head):
        return None
    for signature, kind in _IMAGES + _OTHERS:
        if head.startswith(signature):
            return kind
    return None


def refuse_non_tar(urls: Sequence[str], sources: Sequence[str]) -> None:
    """`InvalidInput` naming the first shard of a source when it is an image or another archive, not a tar file (one
    read of 512 bytes a source)."""
    firsts = {}
    for url, source in zip(urls, sources):
        firsts.setdefault(source, url)
    for url in firsts.values():
        try:
            kind = not_a_tar(_head(url))
        except OSError:  # unreadable now: the pipeline tells it shard by shard
            continue
        if kind:
            folder = os.path.dirname(url.removeprefix("file://")) or "."
            images = kind in {kind for _, kind in _IMAGES}
            raise InvalidInput(f"shard {url} is not a tar file ({kind}): train_data names webdataset .tar shards"
                               + (f"; {_make_shards(folder)}" if images else ""))
