"""Start writing a file's dirty pages to disk now, without waiting (Linux
`sync_file_range(SYNC_FILE_RANGE_WRITE)`).

The kernel starts writeback on its own only once a tenth of RAM is dirty, so a merge that
writes less than that would leave every byte to its final fsync, which then waits for the
whole output while the CPUs idle. Started chunk by chunk as the merge writes, the disk works
while the ranks copy, and the fsync only waits for the tail. A no-op where the call is
missing; the fsync still makes the output durable.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _call():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start(fd: int, offset: int, nbytes: int) -> None:
    """Begin writing bytes [offset, offset + nbytes) of fd to disk; return at once."""
    fn = _call()
    if fn is not None:
        fn(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # failure only means: later, at fsync
