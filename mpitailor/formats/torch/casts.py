"""Float casts between "fp32", "bf16" and "fp16" on numpy arrays of raw bits, without torch.

Each cast gives, bit for bit, what torch's CPU `Tensor.to(dtype)` gives on x86 (its AVX2 and
AVX-512 kernels, the ones a contiguous 1-D tensor goes through), NaNs included:

  fp32 -> bf16  round to nearest even on the bits; every NaN -> 0xFFFF (torch's vector kernel;
                its scalar path, e.g. a 0-dim tensor or ATEN_CPU_CAPABILITY=default, gives 0x7FC0)
  fp32 -> fp16  IEEE round to nearest even, overflow to +-inf; a NaN keeps its sign and the top
                bits of its payload, quieted (x86 vcvtps2ph: sign | 0x7E00 | mantissa >> 13)
  bf16 -> fp32  exact: bits << 16 (NaN payloads kept, signalling ones too)
  fp16 -> fp32  exact; a NaN keeps sign and payload and is quieted (x86 vcvtph2ps). torch's
                scalar tail (the last len % 8 elements) gives 0x7FFFFFFF instead
  bf16 -> fp16  as bf16 -> fp32 -> fp16 (one rounding: the first step is exact)
  fp16 -> bf16  as fp16 -> fp32 -> bf16, except that every NaN -> 0x7FC0
  x -> x        a copy

Representations: fp32 is '<f4' (or its '<u4' bits), fp16 '<f2' (or its '<u2' bits), bf16, which
numpy has no type for, its '<u2' bits. Work is done in blocks of `_BLOCK` elements, so that a
64 MiB chunk needs no chunk-sized temporaries.
"""
from __future__ import annotations

import numpy as np

from mpitailor.formats.dtypes import canonical

_BLOCK = 1 << 16  # elements per inner block: a block's data and scratch stay in L2

_F4, _U4, _F2, _U2 = (np.dtype(s) for s in ("<f4", "<u4", "<f2", "<u2"))
# What each name may be carried in; the first is what `cast` returns when given no `out`.
_REPR = {"fp32": (_F4, _U4), "bf16": (_U2,), "fp16": (_F2, _U2)}
_FLOAT = {"fp32": _F4, "bf16": _U2, "fp16": _F2}  # the view the arithmetic works on


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype `cast` returns for a dtype name: '<f4', '<u2' (bf16's bits) or '<f2'."""
    return _REPR[_name(name)][0]


def cast(src: np.ndarray, src_dtype: str, dst_dtype: str, out: np.ndarray | None = None
         ) -> np.ndarray:
    """src (1-D, in src_dtype's representation) cast to dst_dtype, into `out` when given (1-D,
    same length, in one of dst_dtype's representations), else into a new array of
    `numpy_dtype(dst_dtype)`. Returns out (or the new array)."""
    s, d = _name(src_dtype), _name(dst_dtype)
    src = _check(src, s, "src")
    if out is None:
        out = np.empty(len(src), _REPR[d][0])
    else:
        _check(out, d, "out")
        if len(out) != len(src):
            raise ValueError(f"out has {len(out)} elements, src {len(src)}")
    if np.shares_memory(src, out):
        raise ValueError("out overlaps src")
    x, y = src.view(_FLOAT[s]), out.view(_FLOAT[d])
    if s == d:
        np.copyto(y, x)
        return out
    n = len(x)
    scratch = _Scratch(min(n, _BLOCK))
    kernel = _KERNELS[s, d]
    with np.errstate(all="ignore"):
        for i in range(0, n, _BLOCK):
            kernel(x[i:i + _BLOCK], y[i:i + _BLOCK], scratch)
    return out


def _name(dtype: str) -> str:
    name = canonical(dtype)
    if name not in _REPR:
        raise ValueError(f"cannot cast {dtype!r}: only {', '.join(_REPR)}")
    return name


def _check(a, name: str, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.ndim != 1:
        raise ValueError(f"{what} must be a 1-D numpy array")
    if a.dtype not in _REPR[name]:
        allowed = " or ".join(repr(t.str) for t in _REPR[name])
        raise ValueError(f"{what} is {a.dtype.str!r}; {name} is carried as {allowed}")
    return a


class _Scratch:
    """Per-call block buffers."""
    __slots__ = ("u4", "mask", "idx")

    def __init__(self, n: int):
        self.u4 = np.empty(n, _U4)
        self.mask = np.empty(n, np.bool_)
        self.idx = np.empty(n, np.intp)


def _nan_mask(x: np.ndarray, sc: _Scratch) -> np.ndarray | None:
    """The NaN lanes of an fp32 block, or None (the usual case) when there are none."""
    m = np.isnan(x, out=sc.mask[:len(x)])
    return m if m.any() else None


def _fp32_bf16(x, y, sc):
    """Round to nearest even: (u + 0x7FFF + ((u >> 16) & 1)) >> 16; NaN -> 0xFFFF."""
    u, t = x.view(_U4), sc.u4[:len(x)]
    np.right_shift(u, 16, out=t)
    t &= 1
    t += 0x7FFF
    t += u
    np.right_shift(t, 16, out=y, casting="unsafe")
    if (m := _nan_mask(x, sc)) is not None:
        y[m] = 0xFFFF


def _fp32_fp16(x, y, sc):
    """numpy's cast (IEEE round to nearest even, overflow to inf), but a NaN -> sign | 0x7E00 |
    mantissa >> 13, as x86's vcvtps2ph (numpy leaves it unquieted, or makes up a payload)."""
    np.copyto(y, x, casting="unsafe")
    if (m := _nan_mask(x, sc)) is not None:
        u = x.view(_U4)[m]
        y.view(_U2)[m] = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x03FF)


def _bf16_fp32(x, y, sc):
    np.left_shift(x, 16, out=y.view(_U4), dtype=_U4)


def _fp16_fp32(x, y, sc):
    """numpy's cast (exact), but a NaN keeps sign and payload and is quieted, as vcvtph2ps."""
    np.copyto(y, x, casting="unsafe")
    if (m := _nan_mask(y, sc)) is not None:
        np.bitwise_or(y.view(_U4), 0x00400000, out=y.view(_U4), where=m)


# bf16 <-> fp16 are lookups in a 2^16-entry table (twice as fast as going through fp32),
# built on first use by going through fp32: exact, then one rounding.
def _bf16_fp16_def(x, y, sc):
    f = np.empty(len(x), _F4)
    _bf16_fp32(x, f, sc)
    _fp32_fp16(f, y, sc)


def _fp16_bf16_def(x, y, sc):
    """Except that here torch gives every NaN 0x7FC0."""
    f = np.empty(len(x), _F4)
    _fp16_fp32(x, f, sc)
    nan = np.isnan(f)
    _fp32_bf16(f, y, sc)
    y[nan] = 0x7FC0


_TABLES: dict[tuple[str, str], np.ndarray] = {}


def _lookup(s: str, d: str, define):
    def kernel(x, y, sc):
        if (table := _TABLES.get((s, d))) is None:
            table = np.empty(1 << 16, _U2)
            define(np.arange(1 << 16, dtype=_U2).view(_FLOAT[s]), table.view(_FLOAT[d]),
                   _Scratch(1 << 16))
            _TABLES[s, d] = table
        i = sc.idx[:len(x)]
        np.copyto(i, x.view(_U2))
        np.take(table, i, out=y.view(_U2))
    return kernel


_KERNELS = {("fp32", "bf16"): _fp32_bf16, ("fp32", "fp16"): _fp32_fp16,
            ("bf16", "fp32"): _bf16_fp32, ("fp16", "fp32"): _fp16_fp32,
            ("bf16", "fp16"): _lookup("bf16", "fp16", _bf16_fp16_def),
            ("fp16", "bf16"): _lookup("fp16", "bf16", _fp16_bf16_def)}
