"""Outputs beyond the native ZeRO-3 checkpoint: consolidated HF weights, Universal layout."""
from __future__ import annotations


def contiguous_chunks(sizes: list[tuple[str, int]], parts: int) -> list[list[str]]:
    """Names, kept in order, split into at most `parts` contiguous runs of about equal size
    (one per MPI rank); empty runs are dropped."""
    total = sum(n for _, n in sizes) or 1
    chunks: list[list[str]] = [[] for _ in range(parts)]
    done = 0
    for name, n in sizes:
        chunks[min(parts - 1, done * parts // total)].append(name)
        done += n
    return [c for c in chunks if c]
