"""Bounded reads of the small files that describe a checkpoint: manifests, save records,
`latest`, config.json, safetensors headers, tokenizer side files.

They come with the checkpoint, so they are untrusted: a FIFO where a manifest should be
would block forever, a link to /dev/zero would be read until memory runs out, JSON nested
a few thousand levels deep escapes json.loads as a RecursionError. Every such file is
opened without following a link (unless the caller says links are legitimate there, and
has checked where they lead), checked to be a regular file after it is opened (fstat), and
read only up to a limit fitting what it is. A file that fails is refused with one line that
says what it is instead (never its content). Torch-free.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from mpitailor.display import shown  # noqa: F401 - names in messages, escaped (re-exported)
from mpitailor.errors import CheckpointError
from mpitailor.formats.io.fileio import FILE_CHUNK

# Limits, each far above what a real file of its kind holds, and far below what would hurt.
# A manifest (partial save, merge, export) or a full save's record: a record (~100 bytes)
# per file and the names of its layers; a 1024-rank partial save of a 70B model is under 1 MiB.
MAX_MANIFEST_BYTES = 64 << 20
# An HF config.json: a few KB; classification heads with ~20k labels reach ~1 MiB.
MAX_CONFIG_BYTES = 16 << 20
# An HF side file copied into an export (tokenizer.json, tokenizer.model, vocab, merges):
# Gemma's tokenizer.json (~33 MB) is about the largest in common use.
MAX_SIDE_FILE_BYTES = 64 << 20
# A safetensors index (weight map: one line per tensor; ~2 MiB for the largest models).
MAX_INDEX_BYTES = 64 << 20
# A safetensors header: the safetensors library's own limit (MAX_HEADER_SIZE, 100 MB).
MAX_SAFETENSORS_HEADER = 100_000_000
# Metadata nests a few levels (a manifest 4, a safetensors header 3, an HF config ~5).
# json.loads gives up near 1000 with a RecursionError, and code walking a parsed document
# (json.dumps with indent) far earlier: anything deeper than this is not metadata.
MAX_JSON_DEPTH = 64


class TooLarge(CheckpointError):
    """A file larger than its kind ever is (callers may say it in their own words)."""


def kind_of(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return words
    return "not a regular file"


def open_regular(path: Path | str, what: str, *, follow: bool = False) -> int:
    """A read-only fd of `path`, a regular file; CheckpointError (one line naming it)
    otherwise. follow=False: a symbolic link is refused, not followed (O_NOFOLLOW).
    O_NONBLOCK: a FIFO that slipped in between the stat and the open does not block."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{shown(path)}: {what} not found") from None
    except OSError as e:
        raise CheckpointError(f"{shown(path)}: cannot read {what} ({e.strerror})") from None
    _require_regular(path, st.st_mode, what)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise CheckpointError(f"{shown(path)}: cannot read {what} ({e.strerror})") from None
    try:
        _require_regular(path, os.fstat(fd).st_mode, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _require_regular(path: Path | str, mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{shown(path)}: {kind_of(mode)}, not a regular file; "
                              f"{what} must be a regular file")


def read_small(path: Path | str, limit: int, what: str, *, follow: bool = False) -> bytes:
    """The bytes of regular file `path`, at most `limit` of them (TooLarge if it holds more).
    what: what the file should be, for the message (e.g. "the partial save's manifest")."""
    fd = open_regular(path, what, follow=follow)
    try:
        return read_bounded(fd, path, limit, what)
    finally:
        os.close(fd)


def read_bounded(fd: int, path: Path | str, limit: int, what: str) -> bytes:
    """read_small of a file already open (`fd`; `path` names it in messages): the bytes a
    caller checked through that descriptor, whatever the name stands for by now. Read from
    byte 0 with pread: the descriptor's own offset is wherever its last reader left it."""
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise too_large(path, size, limit, what)
        chunks, got = [], 0
        while got <= limit:  # a file growing while read stops at limit + 1 bytes
            chunk = os.pread(fd, min(limit + 1 - got, FILE_CHUNK), got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise CheckpointError(f"{shown(path)}: cannot read {what} ({e.strerror})") from None
    if got > limit:
        raise too_large(path, got, limit, what)
    return b"".join(chunks)


def too_large(path: Path | str, size: int, limit: int, what: str) -> TooLarge:
    return TooLarge(f"{shown(path)}: {size} bytes, larger than {what} ever is "
                    f"({_size(limit)} at most); is it the right file?")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def loads(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, with nesting deeper than max_depth a ValueError (never RecursionError)."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    if not _depth_within(doc, max_depth):
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return doc


def _depth_within(doc: Any, limit: int) -> bool:
    """Is every list and object of `doc` nested at most `limit` deep? (Iterative: a walk
    that recursed would fail on the very documents it is there to catch.)"""
    stack = [(doc, 1)] if isinstance(doc, (dict, list)) else []
    while stack:
        obj, depth = stack.pop()
        if depth > limit:
            return False
        items = obj.values() if isinstance(obj, dict) else obj
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return True


def read_json(path: Path | str, limit: int, what: str, *, max_depth: int = MAX_JSON_DEPTH,
              follow: bool = False) -> Any:
    """The JSON document in `path` (read_small's checks, then loads'); CheckpointError naming
    the file if it is not one."""
    data = read_small(path, limit, what, follow=follow)
    try:
        return loads(data, max_depth)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise CheckpointError(f"{shown(path)}: not a readable JSON file ({_first_line(e)}); "
                              f"{what} is damaged") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().split("\n")[0]
