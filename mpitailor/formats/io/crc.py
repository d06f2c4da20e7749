"""CRC-32 arithmetic that Python's zlib module lacks: joining CRCs, and CRCs of zeros.

A file written in pieces, perhaps by several processes, has its CRC-32 joined from the
pieces' CRCs and lengths, never by reading it back. This is zlib's `crc32_combine` (the
1.2.12+ form: multiplication by x^(8*len) modulo the CRC polynomial. The older form squares
32x32 GF(2) matrices to build the same linear operator; this one needs ~32x fewer steps per
bit of the length, which matters in Python).

Bits are reflected, as in zlib: bit 31 of a word is the coefficient of x^0.

`crc32` itself is zlib-ng's: the same CRC-32 as zlib's, with carry-less multiplication
(PCLMULQDQ): 11 GB/s against zlib's 2-4 GB/s on the development machine, so that taking
the CRC of what a merge copies costs a fraction of the copy.
"""
from __future__ import annotations

from zlib_ng.zlib_ng import crc32  # noqa: F401  (re-exported)

_POLY = 0xEDB88320  # the CRC-32 polynomial, reflected
_ONE = 1 << 31  # x^0


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial."""
    m, p = _ONE, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    # x^(2^k) for k = 0..63, squared directly: zlib reuses 32 entries (x's order divides
    # 2^32-1), but a longer table keeps this free of that number-theoretic shortcut.
    p, table = 1 << 30, []  # x^1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()


def _x8n(n: int) -> int:
    """x^(8n) modulo the polynomial: the operator that shifts a CRC through n bytes."""
    if n < 0 or n >= 1 << 61:
        raise ValueError(f"length out of range: {n}")
    p, k = _ONE, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B, from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    return _multmodp(_x8n(len2), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)


def crc32_zeros(n: int, crc: int = 0) -> int:
    """CRC-32 after n more zero bytes, continuing from `crc` (as zlib.crc32(bytes(n), crc)).

    O(log n): no n-byte buffer. Zeros feed nothing into the register, so only its
    pre/post-conditioning (xor with all ones) makes this differ from a plain shift.
    """
    return _multmodp(_x8n(n), (crc & 0xFFFFFFFF) ^ 0xFFFFFFFF) ^ 0xFFFFFFFF
