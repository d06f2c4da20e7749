"""Moving source bytes over MPI to the rank that writes them (node-local storage).

A rank that must write bytes held on another node's disk asks a rank of that node for them:
every writer sends its requests to their readers (one all-to-all), then the readers send the
bytes in rounds of bounded size (each round one all-to-all), and the writer puts each chunk
straight at its place in the output file. Chunks of one request arrive in order, so the
writer takes the request's CRC-32 as they come.

Collective: every rank calls `exchange`, with or without requests, and all ranks run the
same number of rounds. A rank whose read or write fails goes on taking part in the rounds
(sending nothing more) and the caller raises the error afterwards, on every rank, through
Comm.step: one failing rank never leaves the others waiting in an all-to-all.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpitailor.cluster.comm import Comm

MESSAGE_PIECE = 4 << 20  # bytes of one message item: a request is sent in pieces of this size
ROUND = 64 << 20  # bytes a rank sends per round, all destinations together


@dataclass(frozen=True, slots=True)
class Request:
    """`nbytes` bytes of what `what` names (the reader knows how to read it), wanted by the
    writer under `key`."""

    key: int
    what: tuple
    nbytes: int


@dataclass
class Exchanged:
    crcs: dict[int, int]       # writer: key -> CRC-32 of the bytes received for it
    bytes_sent: int = 0
    bytes_received: int = 0
    error: Exception | None = None


def exchange(comm: Comm, wanted: dict[int, list[Request]],
             read: Callable[[tuple, int, int], bytes],
             write: Callable[[int, int, bytes], int]) -> Exchanged:
    """Collective. wanted: reader rank -> this rank's requests of it. read(what, offset, n):
    n bytes of `what` from offset (on the reader). write(key, offset, data) -> the running
    CRC-32 after data (on the writer, which keeps it)."""
    asked = comm.alltoall([wanted.get(r, []) for r in range(comm.size)])
    queue = [(writer, req.key, req.what, off, min(MESSAGE_PIECE, req.nbytes - off))
             for writer, reqs in enumerate(asked) for req in reqs
             for off in range(0, req.nbytes, MESSAGE_PIECE)]
    rounds = _rounds(queue)
    n_rounds = max(comm.allgather(len(rounds)))
    out = Exchanged({})
    for i in range(n_rounds):
        sends: list[list] = [[] for _ in range(comm.size)]
        for writer, key, what, off, n in (rounds[i] if i < len(rounds) else []):
            if out.error is not None:
                break
            try:
                sends[writer].append((key, off, read(what, off, n)))
            except Exception as e:  # noqa: BLE001 - raised after the rounds, on every rank
                out.error = e
            else:
                out.bytes_sent += n
        for items in comm.alltoall(sends):
            for key, off, data in items:
                out.bytes_received += len(data)
                if out.error is not None:
                    continue
                try:
                    out.crcs[key] = write(key, off, data)
                except Exception as e:  # noqa: BLE001
                    out.error = e
    return out


def _rounds(queue: list) -> list[list]:
    rounds: list[list] = []
    size = ROUND
    for item in queue:
        if size + item[-1] > ROUND:
            rounds.append([])
            size = 0
        rounds[-1].append(item)
        size += item[-1]
    return rounds
