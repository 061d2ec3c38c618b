"""Streaming reader for tar shards: members with their byte offsets, grouped into webdataset samples by key.

Only what webdataset/img2dataset shards use is parsed: ustar/GNU/pax headers, regular files, GNU long names and
pax ``path``/``size`` records. Every member carries the offset of its header, so a reader can stop anywhere and
later resume by seeking to that offset.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

BLOCK = 512
_KEY_EXT = re.compile(r"^((?:.*/|)[^./][^/]*?)\.([^/]*)$")


class TarError(Exception):
    """A shard that cannot be read to its end; ``offset`` is where the unreadable header or member starts."""

    def __init__(self, message: str, offset: int = -1):
        super().__init__(message)
        self.offset = offset


class TruncatedTarError(TarError):
    """The stream ended inside a member or before the end-of-archive blocks."""


class CorruptTarError(TarError):
    """A header whose checksum or fields are invalid."""


class TarMember(NamedTuple):
    name: str
    data: bytes
    offset: int  # byte offset of the member's first header (pax/long-name headers included)


def _read_exact(stream: BinaryIO, size: int, member_start: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise TruncatedTarError(f"stream ended inside the member at offset {member_start}", member_start)
    return data


def _number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large values
        value = int.from_bytes(field, "big", signed=False) & ~(0x80 << (8 * (len(field) - 1)))
        return value
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0  # ValueError when not octal


def _checksum_ok(header: bytes) -> bool:
    try:
        expected = _number(header[148:156])
    except ValueError:
        return False
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    signed = unsigned - 256 * sum(1 for b in header[:148] + header[156:] if b > 127)
    return expected in (unsigned, signed)


def is_tar_start(head: bytes) -> bool:
    """Whether a file's first block `head` begins a tar file: a header with its checksum, or the end-of-archive
    zeros of an empty one."""
    return len(head) == BLOCK and (head == bytes(BLOCK) or _checksum_ok(head))


def _padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK


def _pax_records(data: bytes) -> dict[str, str]:
    records, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        if length <= 0:
            raise CorruptTarError("bad pax record length")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def iter_members(stream: BinaryIO, offset: int = 0) -> Iterator[TarMember]:
    """Yields the regular-file members of a tar stream positioned at ``offset`` (a header boundary)."""
    long_name: str | None = None
    pax: dict[str, str] = {}
    member_start = offset
    while True:
        header = stream.read(BLOCK)
        if not header:
            raise TruncatedTarError(f"no end-of-archive marker at offset {offset}", member_start)
        if len(header) < BLOCK:
            raise TruncatedTarError(f"partial header at offset {offset}", member_start)
        if header == bytes(BLOCK):
            return
        if not _checksum_ok(header):
            raise CorruptTarError(f"header checksum mismatch at offset {offset}", member_start)
        try:
            size = int(pax["size"]) if "size" in pax else _number(header[124:136])
        except ValueError as e:
            raise CorruptTarError(f"bad size field at offset {offset}", member_start) from e
        kind = header[156:157]
        data_start = offset + BLOCK
        if kind in (b"0", b"\0", b"7"):
            data = _read_exact(stream, size, member_start)
            _read_exact(stream, _padded(size) - size, member_start)
            if long_name is not None:
                name = long_name
            elif "path" in pax:
                name = pax["path"]
            else:
                name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                if header[257:262] == b"ustar" and header[345] != 0:
                    prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                    name = f"{prefix}/{name}"
            yield TarMember(name, data, member_start)
            long_name, pax = None, {}
            offset = data_start + _padded(size)
            member_start = offset
            continue
        data = _read_exact(stream, _padded(size), member_start)[:size]
        if kind == b"L":
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == b"x":
            pax = _pax_records(data)
        elif kind not in (b"g", b"K"):  # directories, links, devices: skipped (and their metadata reset)
            long_name, pax = None, {}
            member_start = data_start + _padded(size)
        offset = data_start + _padded(size)


def split_key(name: str) -> tuple[str, str] | None:
    """``dir/000000012.jpg`` -> (``dir/000000012``, ``jpg``); the key ends at the basename's first dot."""
    match = _KEY_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


class Group(NamedTuple):
    key: str
    files: dict[str, bytes]  # extension -> content
    offset: int  # header offset of the group's first member
    end: int  # header offset of the next group's first member (where to resume after this group)


def iter_groups(members: Iterator[TarMember]) -> Iterator[Group]:
    """Groups consecutive members sharing a key; the last group of a complete archive has ``end == -1``.

    On a truncated or corrupt stream the group read so far (its complete members only) is yielded with ``end`` at
    the bad spot, then the error is raised.
    """
    key, files, start = None, {}, 0
    try:
        for member in members:
            split = split_key(member.name)
            if split is None:
                continue
            member_key, ext = split
            if member_key != key:
                if key is not None:
                    yield Group(key, files, start, member.offset)
                key, files, start = member_key, {}, member.offset
            files.setdefault(ext, member.data)
    except TarError as e:
        if key is not None:
            yield Group(key, files, start, e.offset)
        raise
    if key is not None:
        yield Group(key, files, start, -1)
