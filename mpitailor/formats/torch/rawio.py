"""Byte-range I/O on torch-serialised files: read exactly the bytes of a tensor slice.

A loaded tensor (tensorref.Tensor) knows the byte offset of its storage in its file, so a
slice of a flat buffer is one `preadv` straight into the destination buffer: no page of the
source is mapped into the process, and no byte outside the slice is read. Every read of a
whole tensor goes through its storage, which refuses a byte outside itself.
"""
from __future__ import annotations

import os

from mpitailor.formats.io import read_into
from mpitailor.formats.torch.tensorref import Tensor

__all__ = ["copied", "materialize", "read_into", "read_slice"]


def read_slice(fd: int, t: Tensor, start: int, length: int):
    """Elements [start, start+length) of 1-D file tensor `t`, read from file `fd`, as a
    numpy array (bf16: its uint16 bits)."""
    if start < 0 or length < 0 or start + length > t.numel():
        raise ValueError(f"elements [{start}, {start + length}) of a tensor of {t.numel()}")
    out = bytearray(length * t.itemsize)
    read_into(fd, t.file_offset + start * t.itemsize, out)
    return Tensor.of_bytes(out, t.dtype, (length,)).raw()


def materialize(obj, skip: frozenset[int] = frozenset()):
    """Read into memory the bytes of every tensor in obj, except those whose id() is in
    `skip` (the big flat buffers, read later slice by slice): the tensors then travel with
    obj to ranks that cannot read its files. Returns obj. Each container is walked once,
    however often the file shares it."""
    fds: dict = {}
    seen: set[int] = set()
    try:
        stack = [obj]
        while stack:
            x = stack.pop()
            if isinstance(x, Tensor):
                s = x.storage
                if id(x) not in skip and s.data is None and s.path is not None:
                    # one descriptor per file loaded (a path loaded twice, checked each time)
                    key = (s.path, s.identity)
                    if key not in fds:
                        fds[key] = s.open()
                    s.hold(bytes(s.read(fd=fds[key])))
            elif isinstance(x, (dict, list, tuple)) and id(x) not in seen:
                seen.add(id(x))
                stack.extend(x.values() if isinstance(x, dict) else x)
    finally:
        for fd in fds.values():
            os.close(fd)
    return obj


def copied(obj, fd: int, skip: frozenset[int] = frozenset(), _memo: dict | None = None):
    """A copy of obj in which every tensor but those whose id() is in `skip` is read from
    `fd` into a new contiguous tensor of its own (once: a tensor the file shares stays
    shared), and every dict, list and tuple is new. A full checkpoint's optimizer state is
    held in this form, which writes containers the file shared unshared: keep it, or the
    pickles of merged optimizer files change. (The reader bounds how large a file's
    containers are when unshared, and how many bytes its views hold: safeload.)"""
    memo = {} if _memo is None else _memo
    if isinstance(obj, Tensor):
        if id(obj) in skip:
            return obj
        if id(obj) not in memo:
            memo[id(obj)] = Tensor.of_bytes(obj.values(fd).tobytes(), obj.dtype, obj.shape)
        return memo[id(obj)]
    if isinstance(obj, dict):
        # item by item, not type(obj)(pairs): a Counter made from pairs counts the pairs;
        # and with the attributes the file gave it (an OrderedDict's _metadata)
        new = type(obj)()
        for k, v in obj.items():
            new[k] = copied(v, fd, skip, memo)
        if getattr(obj, "__dict__", None):
            new.__dict__.update(obj.__dict__)
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(copied(v, fd, skip, memo) for v in obj)
    return obj
