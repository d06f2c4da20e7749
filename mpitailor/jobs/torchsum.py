"""Sums of float64 arrays, added up as torch's CPU sum adds them (for `diff`).

The report's sums were torch's `.sum()`; numpy adds in another order, and the last bits of
`rel_norm_diff` (printed whole by --json) would differ. torch's kernel (ATen SumKernel.cpp,
cascade_sum, the AVX2 build, which AVX-512 machines run too) splits an array of at least
GRAIN_SIZE elements into one contiguous part per thread, sums each part in 4 x 4 lanes
(vectors of 4 doubles, 4 at a time), each lane a cascade of sequential sums of 2^k rows
(k >= 4), then joins lanes and parts in a fixed order. Replayed here block-wise.
"""
from __future__ import annotations

import functools
import os

import numpy as np

_GRAIN = 32768  # at::internal::GRAIN_SIZE: fewer elements are summed by one thread
_VEC = 4        # doubles per vector in the kernel torch runs (AVX2's 256 bits)


def torch_sum(x: np.ndarray) -> float:
    """sum(x) of a 1-D float64 array, bit for bit what torch's CPU sum gives."""
    n, threads = len(x), _threads()
    if n < _GRAIN or threads == 1:
        return 0.0 + _serial_sum(x)
    parts = min(threads, -(-n // _GRAIN))
    step = -(-n // parts)
    partial = np.zeros(threads)  # one slot per thread, unused ones 0
    for i, lo in enumerate(range(0, n, step)):
        partial[i] = 0.0 + _serial_sum(x[lo:lo + step])
    return 0.0 + _serial_sum(partial)


def _serial_sum(x: np.ndarray) -> float:
    """One thread's sum (vectorized_inner_sum; under 4 elements row_sum on scalars)."""
    n = len(x)
    if n < _VEC:
        return float(_row_sum(x, 1)[0])
    acc = 0.0
    for v in x[n // _VEC * _VEC:].tolist():  # the elements after the last whole vector
        acc += v
    for v in _row_sum(x, _VEC).tolist():     # then the lanes, one after another
        acc += v
    return acc


def _row_sum(x: np.ndarray, width: int) -> np.ndarray:
    """row_sum over x's whole vectors of `width`: the (width,) lane sums."""
    nvec = len(x) // width
    rows = nvec // 4  # 4 vectors side by side (ilp_factor)
    p = _multi_row_sum(x[:rows * 4 * width].reshape(rows, 4 * width)).reshape(4, width)
    p0 = p[0].copy()
    for v in range(rows * 4, nvec):
        p0 += x[v * width:(v + 1) * width]
    return ((p0 + p[1]) + p[2]) + p[3]


def _multi_row_sum(rows: np.ndarray) -> np.ndarray:
    """multi_row_sum: column sums of rows, in 4 levels: level 0 sums 2^k rows, level 1 2^k
    of those, level 2 2^k of level 1's, level 3 all of level 2's; the rows after the last
    whole block go to level 0; then levels 0 + 1 + 2 + 3."""
    size, lanes = rows.shape
    step = 1 << max(4, (size - 1).bit_length() // 4 if size > 1 else 0)
    levels = []
    for _ in range(3):
        whole = len(rows) // step * step
        levels.append(_seq(rows[whole:][None])[0])
        rows = _seq(rows[:whole].reshape(-1, step, lanes))
    levels.append(_seq(rows[None])[0])
    return ((levels[0] + levels[1]) + levels[2]) + levels[3]


def _seq(a: np.ndarray) -> np.ndarray:
    """Sums over axis 1 of a (k, n, lanes) array, adding one row after another to 0."""
    out = np.zeros((a.shape[0], a.shape[2]))
    for j in range(a.shape[1]):
        out += a[:, j]
    return out


@functools.cache
def _threads() -> int:
    """How many threads torch's sum used: MKL's count, which torch adopts. MKL_NUM_THREADS,
    else OMP_NUM_THREADS, at most the physical cores; else 1 under an MPI launcher (MKL's
    rule; Hydra's mpiexec sets MPI_LOCALNRANKS); else the physical cores this process may
    run on."""
    cores = _physical_cores()
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        first = os.environ.get(var, "").split(",")[0].strip()
        if first.isdigit() and int(first) > 0:
            return min(int(first), cores)
    return 1 if "MPI_LOCALNRANKS" in os.environ else cores


def _physical_cores() -> int:
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores, cpu, phys = set(), None, "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu, phys = int(value), "0"
                elif key == "physical id":
                    phys = value
                elif key == "core id" and cpu in cpus:
                    cores.add((phys, value))
    except (OSError, ValueError):
        pass
    return len(cores) or len(cpus) or 1
