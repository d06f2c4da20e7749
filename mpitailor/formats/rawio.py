"""Byte-range I/O on torch-serialised files: read exactly the bytes of a tensor slice.

A loaded tensor (tensorref.Tensor) knows the byte offset of its storage in its file, so a
slice of a flat buffer is one `preadv` straight into the destination buffer: no page of the
source is mapped into the process, and no byte outside the slice is read.
"""
from __future__ import annotations

import os

from mpitailor.formats.tensorref import Tensor


def read_into(fd: int, offset: int, out) -> None:
    """Fill the writable buffer `out` (a numpy array, a bytearray) with the bytes at
    `offset` of file `fd`."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"file ends {len(view) - done} bytes early")
        done += n


def read_slice(fd: int, t: Tensor, start: int, length: int):
    """Elements [start, start+length) of 1-D file tensor `t`, read from file `fd`, as a
    numpy array (bf16: its uint16 bits)."""
    out = bytearray(length * t.itemsize)
    read_into(fd, t.file_offset + start * t.itemsize, out)
    return Tensor.of_bytes(out, t.dtype, (length,)).raw()


def materialize(obj, skip: frozenset[int] = frozenset()):
    """Read into memory the bytes of every tensor in obj, except those whose id() is in
    `skip` (the big flat buffers, read later slice by slice): the tensors then travel with
    obj to ranks that cannot read its files. Returns obj."""
    fds: dict = {}
    try:
        _materialize(obj, skip, fds)
    finally:
        for fd in fds.values():
            os.close(fd)
    return obj


def _materialize(obj, skip: frozenset[int], fds: dict) -> None:
    if isinstance(obj, Tensor):
        s = obj.storage
        if id(obj) not in skip and s.data is None and s.path is not None:
            if s.path not in fds:
                fds[s.path] = os.open(s.path, os.O_RDONLY)
            data = bytearray(s.nbytes)
            read_into(fds[s.path], s.offset, data)
            s.data = bytes(data)
    elif isinstance(obj, dict):
        for v in obj.values():
            _materialize(v, skip, fds)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _materialize(v, skip, fds)


def copied(obj, fd: int, skip: frozenset[int] = frozenset()):
    """A copy of obj in which every tensor but those whose id() is in `skip` is read from
    `fd` into a new contiguous tensor of its own, and every dict, list and tuple is new.
    A full checkpoint's optimizer state is held in this form, and the merges have always
    written it so (containers the file shared are written unshared): keep it, or the
    pickles of merged optimizer files change."""
    if isinstance(obj, Tensor):
        if id(obj) in skip:
            return obj
        data = bytearray(obj.nbytes)
        read_into(fd, obj.file_offset, data)
        return Tensor.of_bytes(data, obj.dtype, obj.shape)
    if isinstance(obj, dict):
        return type(obj)((k, copied(v, fd, skip)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(copied(v, fd, skip) for v in obj)
    return obj
