"""The one interface of a source shard, full (`shard.RankShard`) or partial
(`partial_shard.PartialShard`): what the copy engine, the exports and the checks read through.

A shard is one rank's files of a checkpoint: its model states and optimizer state (parsed,
held in memory without their flat buffers) and one data file, held open, that stores the
flat buffers' bytes. The two kinds differ only in where those bytes lie (`byte_ranges`), in
whether a buffer is a zip record of its own (`whole_record`) and in how their CRCs are checked
(`verify`); reading, reopening and closing are written once, here. A reopen is of the very
file that was opened and checked (its identity, recorded then), never of whatever its name
stands for by then.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import FileIdentity, open_same
from mpitailor.formats.torch import rawio
from mpitailor.formats.zero.layout import ELEMENT
from mpitailor.formats.zero.meta import CheckpointMeta


@dataclass(frozen=True, slots=True)
class ShardStates:
    """A shard's model states and optimizer state without its data file: what a reshard's
    partitions start from, sent to ranks on nodes that do not hold the file (it pickles;
    a shard's open descriptor would mean nothing on another rank)."""

    model: dict
    optim: dict   # as the shard holds it: the flat buffers are not in memory


@dataclass
class Shard(ABC):
    """Rank `rank`'s files of a checkpoint, open for byte-range reads of its flat buffers
    (fp32 master weights, exp_avg, exp_avg_sq per sub-group)."""

    meta: CheckpointMeta
    rank: int
    model: dict
    optim: dict   # DeepSpeed's optimizer state; its flat buffers are not in memory
    fd: int       # the data file (`data_path`); -1 between close() and reopen()
    # the data file as it was when opened and checked: what reopen() must find again
    identity: FileIdentity = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.identity = FileIdentity.of(self.fd)

    @property
    @abstractmethod
    def data_path(self) -> Path:
        """The file that holds the flat buffers' bytes (the one `fd` is open on)."""

    @abstractmethod
    def byte_ranges(self, kind: str, g: int, start: int, n: int) -> list[tuple[int, int, int]]:
        """Where elements [start, start + n) of sub-group g's `kind` buffer lie:
        (open file descriptor, byte offset, byte count) runs, in order."""

    @abstractmethod
    def verify(self, used: set[tuple[str, int]]) -> None:
        """Check the bytes of these (kind, sub-group) buffers against their recorded CRC-32;
        CheckpointError if one differs."""

    def whole_record(self, kind: str, g: int) -> tuple[int, int] | None:
        """(CRC-32, bytes) of sub-group g's `kind` buffer if the file stores it as a record of
        its own with a known CRC (a copy of all of it can take that CRC as it is); None: the
        copy computes the CRC itself."""
        return None

    @property
    def inner(self) -> dict:
        """The torch optimizer's state dict (state per sub-group, param groups)."""
        osd = self.optim["optimizer_state_dict"]
        return osd["base_optimizer_state"] if self.meta.layout.flat else osd["optimizer_state_dict"]

    def states(self) -> ShardStates:
        """The states with every tensor's bytes in memory but the flat buffers'."""
        return ShardStates(rawio.materialize(self.model), self.optim)

    def path_of(self, fd: int) -> str:
        """The file behind one of this shard's descriptors (for error messages)."""
        return str(self.data_path)

    def read_into(self, kind: str, g: int, start: int, out) -> None:
        """Fill the float32 numpy array `out` with elements [start, start + out.size) of
        sub-group g's flat buffer of kind fp32/exp_avg/exp_avg_sq."""
        pos = 0
        for fd, offset, nbytes in self.byte_ranges(kind, g, start, out.size):
            try:
                rawio.read_into(fd, offset, out[pos: pos + nbytes // ELEMENT])
            except (OSError, EOFError) as e:
                raise CheckpointError(f"{self.path_of(fd)}: read failed ({e}); the file is "
                                      f"damaged or truncated") from None
            pos += nbytes // ELEMENT

    def read(self, kind: str, g: int, start: int = 0, length: int | None = None):
        """Those elements as a new float32 numpy array."""
        import numpy as np
        size = self.meta.layout.buffer_size(kind, g, self.rank)
        out = np.empty(size - start if length is None else length, dtype=np.float32)
        self.read_into(kind, g, start, out)
        return out

    def reopen(self) -> None:
        """Open the file again after close() (the parsed metadata is kept): a rank that
        works through many partitions parses each once and holds few descriptors.
        CheckpointError naming the file if its name now stands for another file (renamed
        over it, rewritten): the checks were of the first one."""
        if self.fd < 0:
            self.fd = open_same(self.data_path, self.identity)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
