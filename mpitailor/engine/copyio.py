"""The engine's one copy engine: byte ranges moved between files through a bounded buffer with
the CRC-32 taken on the way, double-buffered with a writer thread; kernel copies where a record
goes unchanged. Merges copy bytes as they are; the HF/fp32 exports read fp32 elements and write
them cast to the output dtype (Copier.cast). All I/O goes through formats/io/storage.py.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from mpitailor.formats.io import (
    crc32,
    crc32_combine,
    fsync_close,
    kernel_copy,
    pread_into,
    write_out,
)
from mpitailor.formats.zero import ELEMENT

COPY_CHUNK = 512 << 10  # bytes per read/write, the copy engine's whole buffer: small enough
# that what preadv brings in is still in the CPU's L2 cache when the CRC and pwrite read it
# (8 MiB chunks made a 1-rank merge 1.5-3x slower on the development machine: three passes
# through RAM). Read as copyio.COPY_CHUNK when a Copier is made, so a test can shrink it.


def join_crcs(ranges: Iterable[tuple[int, int, int]], crc: int = 0, pos: int = 0
              ) -> tuple[int, int]:
    """The CRC-32 of bytes [0, end) of one output, from `crc` (of bytes [0, pos)) and the
    ranks' ranges (first byte, bytes, CRC-32 of them), joined in byte order while they tile:
    (crc, end), end the first byte no range covers. Both executors' outputs (a flat buffer
    of the copy program, an HF weights file) get their CRC this way."""
    for first, n, part in sorted(ranges):
        if first != pos:
            break
        crc, pos = crc32_combine(crc, part, n), pos + n
    return crc, pos


def sync_close(copier: Copier, outs: dict[str, int]) -> None:
    """Wait for the writes in flight, fsync and close the output files."""
    copier.drain()
    fsync_close(outs)


class Copier:
    """Moves chunks of COPY_CHUNK bytes, double-buffered: while a writer thread
    pwrites one chunk, this thread reads (and casts) the next and takes its CRC (preadv, the
    cast, the CRC and pwrite all release the GIL), so that one rank keeps two cores busy.
    Memory: two chunks, and two more for the casts once cast() is used."""

    def __init__(self) -> None:
        self.chunk = COPY_CHUNK
        self.raw = [bytearray(self.chunk) for _ in range(2)]
        self.bufs = [memoryview(b) for b in self.raw]
        self.pending: list[Future | None] = [None, None]
        self.turn = 0
        self.casts: dict[str, list] = {}  # dtype -> per buffer (fp32 view, out view, out bytes)
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="mpitailor-writer")

    def copy(self, src: int, off: int, n: int, dst: int, dst_off: int, crc: int,
             path: str) -> int:
        """Copy n bytes; return the CRC-32 continued over them."""
        done = 0
        while done < n:
            view = self._free_buffer()
            got = pread_into(src, view[:min(self.chunk, n - done)], off + done, path, n - done)
            crc = crc32(view[:got], crc)
            self._write(dst, view[:got], dst_off + done)
            done += got
        return crc

    def cast(self, fill: Callable[[int, object], None], lo: int, hi: int,
             dtype: str, dst: int, dst_off: int, crc: int) -> int:
        """Write elements [lo, hi) of an fp32 stream cast to dtype (a name of dtypes.py),
        from dst_off on; return the CRC-32 continued over the bytes written. fill(first,
        into) puts the elements from `first` on into the float32 numpy array `into`, a
        chunk at a time."""
        from mpitailor.formats.torch import cast
        step = self.chunk // ELEMENT
        for a in range(lo, hi, step):
            n = min(hi - a, step)
            self._free_buffer()
            src, out, out_bytes = self._cast_buffers(dtype)
            fill(a, src[:n])
            if out is None:  # fp32 out: the chunk as read
                data = self.bufs[self.turn][:n * ELEMENT]
            else:
                cast(src[:n], "fp32", dtype, out=out[:n])  # bit for bit torch's .to(dtype)
                data = out_bytes[:n * out.itemsize]
            crc = crc32(data, crc)
            self._write(dst, data, dst_off)
            dst_off += len(data)
        return crc

    def _cast_buffers(self, dtype: str):
        """This turn's buffer as fp32, and its cast's buffer as dtype (bf16: its uint16
        bits) and as bytes (None for fp32), made on first use."""
        if dtype not in self.casts:
            import numpy as np

            from mpitailor.formats.torch import numpy_dtype
            made = []
            for raw in self.raw:
                f32 = np.frombuffer(raw, dtype=np.float32)
                if dtype == "fp32":
                    made.append((f32, None, None))
                else:
                    out_raw = bytearray(self.chunk)
                    made.append((f32, np.frombuffer(out_raw, dtype=numpy_dtype(dtype)),
                                 memoryview(out_raw)))
            self.casts[dtype] = made
        return self.casts[dtype][self.turn]

    def _write(self, dst: int, data, offset: int) -> None:
        self.pending[self.turn] = self.writer.submit(write_out, dst, data, offset)

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
        """Wait for the writes in flight (their errors dropped: drain() raised them, or
        another error is on its way up), so that no descriptor closes under one."""
        self.writer.shutdown(wait=True)


def copy_unchanged(src: int, off: int, n: int, dst: int, dst_off: int, copier: Copier,
                   path: str) -> None:
    """Copy n bytes inside the kernel (storage.kernel_copy, formats/io); through the copier's buffers
    where the file systems cannot."""
    done = kernel_copy(src, off, n, dst, dst_off, path)
    if done < n:
        copier.copy(src, off + done, n - done, dst, dst_off + done, 0, path)
