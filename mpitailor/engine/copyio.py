"""Moving bytes between files for the executor: chunked copies through a bounded buffer with
the CRC-32 taken on the way, double-buffered with a writer thread, kernel copies where a
record goes unchanged, writeback started as the bytes are written."""
from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor

from mpitailor.engine import writeback
from mpitailor.errors import CheckpointError
from mpitailor.formats.crc import crc32

CHUNK = 512 << 10  # bytes per read/write, the executor's whole buffer: small enough that
# what preadv brings in is still in the CPU's L2 cache when the CRC and pwrite read it (8 MiB
# chunks made a 1-rank merge 1.5-3x slower on the development machine: three passes
# through RAM)


def sync_close(copier: Copier, outs: dict[str, int]) -> None:
    """Wait for the writes in flight, fsync and close the output files."""
    copier.drain()
    while outs:
        name, fd = outs.popitem()
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Copier:
    """Copies byte ranges in CHUNKs, double-buffered: while a writer thread pwrites one chunk,
    this thread reads the next and takes its CRC (preadv, the CRC and pwrite all release the
    GIL), so that one rank keeps two cores busy. Memory: two chunks."""

    def __init__(self) -> None:
        self.bufs = [memoryview(bytearray(CHUNK)) for _ in range(2)]
        self.pending: list[Future | None] = [None, None]
        self.turn = 0
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="mpitailor-writer")

    def copy(self, src: int, off: int, n: int, dst: int, dst_off: int, crc: int,
             path: str) -> int:
        """Copy n bytes; return the CRC-32 continued over them."""
        done = 0
        while done < n:
            view = self._free_buffer()
            try:
                got = os.preadv(src, [view[:min(CHUNK, n - done)]], off + done)
            except OSError as e:
                raise CheckpointError(f"{path}: read failed ({e}); the file is damaged") \
                    from None
            if got <= 0:
                raise CheckpointError(f"{path}: ends {n - done} bytes early at offset "
                                      f"{off + done}; the file is truncated")
            crc = crc32(view[:got], crc)
            self.pending[self.turn] = self.writer.submit(write_out, dst, view[:got],
                                                         dst_off + done)
            done += got
        return crc

    def _free_buffer(self) -> memoryview:
        self.turn ^= 1
        if (f := self.pending[self.turn]) is not None:
            self.pending[self.turn] = None
            f.result()  # a failed write raises here
        return self.bufs[self.turn]

    def drain(self) -> None:
        """Wait for every write (their errors raise here)."""
        for i, f in enumerate(self.pending):
            if f is not None:
                self.pending[i] = None
                f.result()

    def close(self) -> None:
        self.writer.shutdown(wait=True)


def copy_unchanged(src: int, off: int, n: int, dst: int, dst_off: int, copier: Copier,
                    path: str) -> None:
    """Copy n bytes inside the kernel (copy_file_range: no pass through this process, a
    reflink where the file system shares extents); chunked copies where it cannot."""
    done = 0
    while done < n:
        try:
            k = os.copy_file_range(src, dst, min(n - done, 64 << 20), off + done,
                                   dst_off + done)  # 64 MiB a call: writeback starts early
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise  # a full disk, an I/O error: as any write's
            copier.copy(src, off + done, n - done, dst, dst_off + done, 0, path)
            return
        if k == 0:
            raise CheckpointError(f"{path}: ends {n - done} bytes early at offset "
                                  f"{off + done}; the file is truncated")
        writeback.start(dst, dst_off + done, k)
        done += k


def write_out(fd: int, data, offset: int) -> None:
    """pwrite a chunk and start its writeback (the final fsync then waits for little)."""
    pwrite_all(fd, data, offset)
    writeback.start(fd, offset, len(data))


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
