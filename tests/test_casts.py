"""mpitailor.formats.torch.casts against torch's CPU `Tensor.to`, bit for bit: every 16-bit pattern of
bf16 and fp16, and for fp32 the special values, every rounding tie at every exponent, a strided
sweep of all 2^32 patterns and 1M random ones."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from mpitailor.formats.torch.casts import cast, numpy_dtype

torch = pytest.importorskip("torch")

NAMES = ("fp32", "bf16", "fp16")
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_INT = {"fp32": (np.int32, torch.int32, np.uint32), "bf16": (np.int16, torch.int16, np.uint16),
        "fp16": (np.int16, torch.int16, np.uint16)}
# torch's NaN bits come from its vector kernels on x86 (see casts.py); elsewhere (another
# architecture, ATEN_CPU_CAPABILITY=default) only NaN-ness is compared on NaN lanes.
X86_VECTOR = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch converts the last len % 8 elements of a (per-thread) range with a scalar loop
    whose NaNs differ from its vector one; one thread and lengths that are multiples of 64 keep
    every element on the vector path."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _pad(bits: np.ndarray) -> np.ndarray:
    return np.concatenate([bits, np.zeros(-len(bits) % 64, bits.dtype)])


def _fp32_patterns() -> np.ndarray:
    rng = np.random.default_rng(20240607)
    specials = np.array([
        0x00000000, 0x80000000,                          # +-0
        0x7F800000, 0xFF800000,                          # +-inf
        0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF,  # quiet NaNs
        0x7FC00001, 0x7FC12345, 0xFFD55555, 0x7FFF8000, 0x7FFF7FFF, 0x7FFFC000,
        0x7F800001, 0xFF800001, 0x7FA00000, 0x7FBFFFFF, 0xFFBFFFFF,  # signalling NaNs
        0x7F808000, 0x7F807FFF, 0x7F810000, 0x7F802000, 0x7F801FFF, 0x7F804000,
        0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # smallest/largest subnormals
        0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF,  # smallest normal, max finite
        0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FC000,  # bf16 overflow edge
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x477FFFFF, 0x47800000,  # fp16 max
        0x33000000, 0x33000001, 0x32FFFFFF, 0x33800000, 0x33C00000,  # fp16 min subnormal
        0x387FC000, 0x387FE000, 0x387FF000, 0x38800000,  # fp16 subnormal/normal edge
        0x3F800000, 0xBF800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF,  # bf16 ties
        0x3F801000, 0x3F803000, 0x3F801001, 0x3F802FFF,  # fp16 ties
    ], np.uint32)
    # Every tie and its neighbours, at every exponent and both signs, for a rounding point at
    # bit 16 (bf16) and at each of bits 13..24 (fp16 normals and subnormals).
    sign_exp = (np.arange(512, dtype=np.uint32) << 23)[:, None, None, None]
    kept = np.array([0, 1, 2, 3, 0x7FFFFF, 0x555555, 0x2AAAAA,
                     *rng.integers(0, 1 << 23, 9)], np.uint32)[None, :, None, None]
    point = np.arange(13, 25, dtype=np.uint32)[None, None, :, None]
    half = np.uint32(1) << (point - 1)
    low = np.stack(np.broadcast_arrays(0 * half, half - 1, half, half + 1, 2 * half - 1), -1)
    mant = ((kept >> point << point) | low[..., 0, :]) & 0x7FFFFF
    ties = (sign_exp | mant).ravel()
    # the bf16 rounding point exhaustively: all 2^16 high halves under edge low halves
    halves = ((np.arange(1 << 16, dtype=np.uint32) << 16)[:, None]
              | np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)).ravel()
    sweep = np.arange(0, 1 << 32, 4093, dtype=np.uint64).astype(np.uint32)  # ~1M, odd stride
    randoms = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)
    return _pad(np.concatenate([specials, ties, halves, sweep, randoms]))


PATTERNS = {"fp32": _fp32_patterns(), "bf16": np.arange(1 << 16, dtype=np.uint16),
            "fp16": np.arange(1 << 16, dtype=np.uint16)}


def _torch_bits(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    np_int, _, _ = _INT[src]
    _, t_int, np_uint = _INT[dst]
    t = torch.from_numpy(bits.view(np_int)).view(_TORCH[src]).to(_TORCH[dst])
    return t.view(t_int).numpy().view(np_uint).copy()


def _as_src(bits: np.ndarray, name: str) -> np.ndarray:
    return bits.view(numpy_dtype(name))


def _compare(got: np.ndarray, want: np.ndarray, src_bits: np.ndarray, dst: str):
    uint = _INT[dst][2]
    got, want = got.view(uint), want.view(uint)
    nan_got = np.isnan(got.view(numpy_dtype(dst)) if dst != "bf16"
                       else (got.astype(np.uint32) << 16).view(np.float32))
    nan_want = np.isnan(want.view(numpy_dtype(dst)) if dst != "bf16"
                        else (want.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_array_equal(nan_got, nan_want)
    lanes = np.ones(len(got), bool) if X86_VECTOR else ~nan_want
    bad = np.flatnonzero((got != want) & lanes)
    assert not len(bad), "first mismatches (src, got, torch): " + ", ".join(
        f"({src_bits[i]:#x}, {got[i]:#x}, {want[i]:#x})" for i in bad[:8])


@pytest.mark.parametrize("dst", NAMES)
@pytest.mark.parametrize("src", NAMES)
def test_matches_torch(src, dst):
    bits = PATTERNS[src]
    want = _torch_bits(bits, src, dst)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid-value warnings from numpy
        got = cast(_as_src(bits, src), src, dst)
    assert got.dtype == numpy_dtype(dst) and len(got) == len(bits)
    _compare(got, want, bits, dst)


@pytest.mark.parametrize("dst", NAMES)
@pytest.mark.parametrize("src", NAMES)
def test_out_and_other_representations(src, dst):
    """Into a preallocated out (reused: stale contents must not leak), from and to the '<u*'
    bits representations, on a length that is not a multiple of the inner block."""
    bits = PATTERNS[src][: (1 << 16) + 37 if src == "fp32" else None]
    want = cast(_as_src(bits, src), src, dst)
    uint = _INT[src][2]
    for out_dtype in {numpy_dtype(dst), np.dtype(_INT[dst][2]).newbyteorder("<")}:
        out = np.full(len(bits), 0x5A, out_dtype)
        res = cast(bits.view(uint) if src != "bf16" else bits, src, dst, out=out)
        assert res is out
        np.testing.assert_array_equal(out.view(_INT[dst][2]), want.view(_INT[dst][2]))


def test_aliases_empty_and_errors():
    one = np.array([1.5], np.float32)
    assert cast(one, "float32", "torch.bfloat16")[0] == 0x3FC0
    assert cast(np.empty(0, np.float32), "fp32", "fp16").dtype == np.float16
    bad = [
        (one, "fp32", "f64", None),                            # not a float cast
        (np.array([1.5], np.float16), "bf16", "fp32", None),   # bf16 must be its bits
        (one.astype(">f4"), "fp32", "bf16", None),             # big-endian
        (one.reshape(1, 1), "fp32", "bf16", None),             # not 1-D
        (one, "fp32", "bf16", np.empty(2, np.uint16)),         # wrong length
        (one, "fp32", "bf16", np.empty(1, np.float16)),        # wrong representation
        (one, "fp32", "fp32", one),                            # out is src
    ]
    for src, s, d, out in bad:
        with pytest.raises(ValueError):
            cast(src, s, d, out=out)
