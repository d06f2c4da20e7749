"""Pickles for the reader fuzzer (reader_fuzzing.py): opcodes as (name, arg) pairs, their
mutations, objects saved by torch.save, and pickles assembled from a grammar of opcodes.

Opcodes are kept as pickletools names with pickletools' args ("module name" for GLOBAL), so
a mutation is a list edit and `encode_ops` writes any list back, valid or not.
"""
from __future__ import annotations

import io
import math
import pickle
import pickletools
import random
import struct
from collections import OrderedDict

# ---- opcodes <-> bytes --------------------------------------------------------------------

_BARE = {o.name: o.code.encode("latin1") for o in pickletools.opcodes if o.arg is None}


def _long(v: int) -> bytes:
    return pickle.encode_long(v) if v else b""


def _utf8(s) -> bytes:
    return s.encode("utf-8", "surrogatepass") if isinstance(s, str) else bytes(s)


_ARGS = {
    "PROTO": lambda a: b"\x80" + bytes([a & 0xFF]),
    "FRAME": lambda a: b"\x95" + struct.pack("<Q", a & (2**64 - 1)),
    "BININT1": lambda a: b"K" + bytes([a & 0xFF]),
    "BININT2": lambda a: b"M" + struct.pack("<H", a & 0xFFFF),
    "BININT": lambda a: b"J" + struct.pack("<i", (a + 2**31) % 2**32 - 2**31),
    "LONG1": lambda a: b"\x8a" + bytes([len(_long(a)) & 0xFF]) + _long(a),
    "INT": lambda a: b"I" + str(int(a)).encode() + b"\n",
    "BINFLOAT": lambda a: b"G" + struct.pack(">d", a),
    "BINUNICODE": lambda a: b"X" + struct.pack("<I", len(_utf8(a))) + _utf8(a),
    "SHORT_BINUNICODE": lambda a: b"\x8c" + bytes([len(_utf8(a)) & 0xFF]) + _utf8(a),
    "SHORT_BINSTRING": lambda a: b"U" + bytes([len(a) & 0xFF]) + a.encode("latin1"),
    "BINBYTES": lambda a: b"B" + struct.pack("<I", len(a)) + a,
    "SHORT_BINBYTES": lambda a: b"C" + bytes([len(a) & 0xFF]) + a,
    "BYTEARRAY8": lambda a: b"\x96" + struct.pack("<Q", len(a)) + a,
    "GLOBAL": lambda a: b"c" + a.replace(" ", "\n", 1).encode("utf-8") + b"\n",
    "BINPUT": lambda a: b"q" + bytes([a & 0xFF]),
    "LONG_BINPUT": lambda a: b"r" + struct.pack("<I", a & 0xFFFFFFFF),
    "BINGET": lambda a: b"h" + bytes([a & 0xFF]),
    "LONG_BINGET": lambda a: b"j" + struct.pack("<I", a & 0xFFFFFFFF),
    "EXT1": lambda a: b"\x82" + bytes([a & 0xFF]),
}


def encode_ops(ops) -> bytes:
    """The bytes of a list of (opcode name, arg); args out of an opcode's range wrap."""
    out = bytearray()
    for name, arg in ops:
        out += _BARE[name] if name in _BARE else _ARGS[name](arg)
    return bytes(out)


def parse_ops(data: bytes) -> list:
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data)]


def int_op(v: int) -> tuple:
    """The opcode torch's pickler writes for int v."""
    if 0 <= v < 256:
        return ("BININT1", v)
    if 0 <= v < 65536:
        return ("BININT2", v)
    return ("BININT", v) if -2**31 <= v < 2**31 else ("LONG1", v)


# ---- what mutations put in -------------------------------------------------------------------

INTS = (0, 1, -1, 2, 3, 7, 63, 64, 255, 256, 65535, 65536, 2**31 - 1, -2**31, 2**32 + 1,
        2**40, 2**62, 2**63, -2**63, 10**30)
STRS = ("storage", "cpu", "cuda:0", "meta", "0", "1", "2", "99", "-1", "../0", "", "data.pkl",
        "storage_offset", "path", "x" * 300)
GLOBALS = (
    "torch._utils _rebuild_tensor_v2", "torch Size", "collections OrderedDict",
    "_codecs encode", "builtins set", "__builtin__ set", "builtins frozenset",
    "builtins bytearray", "builtins complex", "collections Counter", "torch FloatStorage",
    "torch HalfStorage", "torch BFloat16Storage", "torch LongStorage", "torch BoolStorage",
    "torch ByteStorage", "torch DoubleStorage", "torch ComplexFloatStorage",
    "torch UntypedStorage", "torch._tensor _rebuild_from_type_v2",
    "torch._utils _rebuild_parameter", "torch._utils _rebuild_tensor", "torch Tensor",
    "torch._tensor Tensor", "torch.nn.parameter Parameter", "torch device", "torch float32",
    "torch bfloat16", "torch.serialization _get_layout",
    "deepspeed.runtime.fp16.loss_scaler LossScaler",
    "deepspeed.runtime.fp16.loss_scaler DynamicLossScaler",
    "deepspeed.runtime.zero.config ZeroStageEnum",
    "deepspeed.utils.tensor_fragment fragment_address", "numpy.core.multiarray _reconstruct",
    "numpy ndarray", "numpy dtype", "builtins getattr", "builtins eval", "os system",
    "posix system", "subprocess Popen", "collections defaultdict", "argparse Namespace",
    "torch load", "copyreg _reconstructor", "builtins object", "functools partial",
    "__main__ Evil")
# Bare opcodes torch's pickler writes, and a few it never does (the reader's Python
# unpickler knows them all; torch's weights-only unpickler only the first kind).
BARE = ("MARK", "STOP", "NONE", "NEWTRUE", "NEWFALSE", "EMPTY_DICT", "EMPTY_LIST",
        "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "APPENDS", "SETITEM",
        "SETITEMS", "REDUCE", "BUILD", "NEWOBJ", "BINPERSID", "EMPTY_SET", "ADDITEMS",
        "FROZENSET", "DUP", "POP", "POP_MARK", "MEMOIZE", "STACK_GLOBAL", "LIST", "DICT",
        "NEXT_BUFFER", "READONLY_BUFFER", "OBJ", "NEWOBJ_EX")
# Fields of the reader's own records (tensorref's Storage and Tensor, opaque's stand-ins)
# that a BUILD with slot state would set, and what to set them to.
SLOTS = ("path", "offset", "numel", "dtype", "data", "storage_offset", "shape", "stride",
         "storage", "requires_grad", "metadata", "wrapper", "_how", "_args", "_state")


def _rand_op(rng: random.Random, marker: str) -> tuple:
    k = rng.randrange(8)
    if k < 3:
        return (rng.choice(BARE), None)
    if k == 3:
        return int_op(rng.choice(INTS))
    if k == 4:
        return ("BINUNICODE", rng.choice(STRS + (marker,)))
    if k == 5:
        return ("GLOBAL", rng.choice(GLOBALS))
    if k == 6:
        return (rng.choice(("BINGET", "BINPUT", "LONG_BINGET", "LONG_BINPUT")),
                rng.choice((0, 1, 2, 5, 255, 256, 1000, 0x7FFFF, 0x7FFFFF, 0xFFFFFFF0)))
    return rng.choice((("BINFLOAT", math.nan), ("SHORT_BINBYTES", b"abc"),
                       ("BINBYTES", b"\0" * 9), ("SHORT_BINUNICODE", "storage"),
                       ("BYTEARRAY8", b"xy"), ("LONG1", 2**64), ("FRAME", 9),
                       ("SHORT_BINSTRING", "cpu"), ("INT", 5), ("EXT1", 1)))


def build_state(rng: random.Random, marker: str) -> list:
    """Opcodes of a BUILD state: a dict, a (dict, slot dict) pair, or set_'s tuple."""
    pairs = []
    for _ in range(rng.randint(1, 3)):
        slot = rng.choice(SLOTS)
        value = {"path": ("BINUNICODE", marker), "dtype": ("BINUNICODE", "fp32"),
                 "data": ("SHORT_BINBYTES", b"\1" * 8)}.get(slot) or int_op(rng.choice(INTS))
        pairs += [("BINUNICODE", slot), value]
    body = [("EMPTY_DICT", None), ("MARK", None), *pairs, ("SETITEMS", None)]
    k = rng.randrange(4)
    if k == 0:
        return body
    if k == 1:
        return [("NONE", None), *body, ("TUPLE2", None)]
    if k == 2:
        return [("EMPTY_DICT", None)]
    return [("MARK", None), *[int_op(rng.choice(INTS)) for _ in range(rng.randint(0, 4))],
            ("TUPLE", None)]


def _near(ops, rng, names, reach: int) -> int | None:
    """An index within `reach` ops of a random op named in `names` (None if there is none)."""
    at = [i for i, (n, _) in enumerate(ops) if n in names]
    if not at:
        return None
    i = rng.choice(at) + rng.randint(-reach, reach)
    return min(max(i, 0), len(ops) - 1)


def mutate_ops(ops: list, rng: random.Random, donors=(), marker: str = "") -> tuple[list, str]:
    """One mutation of an opcode list: (new list, what was done)."""
    from reader_fuzzing import MARKER_PATH
    marker = marker or MARKER_PATH
    ops = list(ops)
    n = len(ops)
    if n == 0:  # earlier mutations of this input cut everything
        return [_rand_op(rng, marker)], "insert @0"
    what = rng.choice(("delete", "dup", "swap", "insert", "int", "int", "tensor-int",
                       "tensor-int", "persid", "str", "memo", "global", "build", "build",
                       "splice", "truncate"))
    i = rng.randrange(n)
    if what == "delete":
        del ops[i]
    elif what == "dup":
        ops.insert(i, ops[i])
    elif what == "swap" and i + 1 < n:
        ops[i], ops[i + 1] = ops[i + 1], ops[i]
    elif what == "insert":
        ops.insert(i, _rand_op(rng, marker))
    elif what in ("int", "tensor-int", "persid"):
        if what == "tensor-int":  # the offset, shape and stride after a storage
            j = _near(ops, rng, ("BINPERSID",), 0)
            i = j + rng.randint(1, 8) if j is not None else i
        elif what == "persid":  # the storage tuple before it: class, key, location, numel
            j = _near(ops, rng, ("BINPERSID",), 0)
            i = j - rng.randint(1, 10) if j is not None else i
        i = min(max(i, 0), n - 1)
        ints = [k for k in range(max(i - 3, 0), min(i + 4, n))
                if ops[k][0] in ("BININT1", "BININT2", "BININT", "LONG1", "BINUNICODE",
                                 "GLOBAL")]
        if ints:
            i = rng.choice(ints)
            name, arg = ops[i]
            if name == "GLOBAL":
                ops[i] = (name, rng.choice(GLOBALS))
            elif name == "BINUNICODE":
                ops[i] = (name, rng.choice(STRS))
            else:
                v = rng.choice(INTS + (arg + 1, arg - 1, arg * 2, -arg))
                ops[i] = int_op(v)
        what += f" @{i} -> {ops[i][1]!r:.40}"
        return ops, what
    elif what == "str":
        strs = [k for k, (nm, _) in enumerate(ops) if nm in ("BINUNICODE", "SHORT_BINSTRING")]
        if strs:
            i = rng.choice(strs)
            ops[i] = ("BINUNICODE", rng.choice(STRS + tuple(a for _, a in ops[i - 5:i + 5]
                                                             if isinstance(a, str))))
    elif what == "memo":
        memo = [k for k, (nm, _) in enumerate(ops) if "GET" in nm or "PUT" in nm]
        if memo:
            i = rng.choice(memo)
            name, arg = ops[i]
            v = rng.choice((arg + 1, arg - 1, 0, 255, 256, rng.randrange(arg + 2), 0x7FFFF,
                            0xFFFFFFF0))
            ops[i] = (name.replace("LONG_", "") if 0 <= v < 256 and rng.random() < 0.5
                      else "LONG_" + name.replace("LONG_", ""), v)
    elif what == "global":
        glob = [k for k, (nm, _) in enumerate(ops) if nm == "GLOBAL"]
        if glob:
            i = rng.choice(glob)
            ops[i] = ("GLOBAL", rng.choice(GLOBALS))
    elif what == "build":  # BUILD on whatever an op just made
        j = _near(ops, rng, ("REDUCE", "BINPERSID", "NEWOBJ", "BINGET", "EMPTY_DICT"), 0)
        i = (j if j is not None else i) + 1
        ops[i:i] = [*build_state(rng, marker), ("BUILD", None)]
    elif what == "splice" and donors:
        d = rng.choice(donors)
        a = rng.randrange(len(d))
        ops[i:i] = d[a:a + rng.randint(1, 40)]
    elif what == "truncate":
        ops = ops[:i] + [("STOP", None)]
    return ops, f"{what} @{i}"


# ---- objects torch.save writes -----------------------------------------------------------------

def _torch_dtypes():
    import torch
    return ((torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
             torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool) * 4
            + (torch.complex64, torch.uint16, torch.float8_e4m3fn, torch.uint32))


def _new_tensor(rng: random.Random):
    import torch
    dtype = rng.choice(_torch_dtypes())
    shape = tuple(rng.choice((0, 1, 1, 2, 3, 4, 5)) for _ in range(rng.choice((0, 1, 1, 2, 2, 3))))
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    base = torch.randint(-100, 100, shape, generator=g, dtype=torch.int64)
    if dtype.is_floating_point or dtype.is_complex:
        base = base.double() / 7
    return base.to(dtype)


def _view(rng: random.Random, t):
    """A view of t sharing its storage: sliced, strided, transposed, expanded (stride 0), or
    a negated view (torch saves its bytes before negation and a `neg` bit: the attack of
    2026-11-28 that a copy of bytes got wrong)."""
    k = rng.randrange(8)
    try:
        if k == 0 and t.dim() and t.shape[0] > 1:
            return t[1:]
        if k == 1 and t.dim():
            return t[::2]
        if k == 2 and t.dim() >= 2:
            return t.transpose(0, 1)
        if k == 3:
            return t.reshape(-1)[:1].expand(rng.randint(0, 4), rng.randint(1, 3))
        if k == 4 and t.numel():
            return t.reshape(-1)[-1:]  # a one-element view at the storage's end
        if k == 5 and t.dim():
            return t.unsqueeze(0).expand(2, *t.shape)
        if k == 6 and t.is_floating_point():
            return t._neg_view()
        return t.reshape(-1)[rng.randrange(t.numel() + 1):]
    except RuntimeError:
        return t


def _scalar(rng: random.Random):
    import torch
    return rng.choice((
        lambda: rng.choice(INTS), lambda: rng.random() * 10, lambda: math.nan,
        lambda: -0.0, lambda: math.inf, lambda: "é\u2603" * rng.randint(0, 3),
        lambda: "\ud800", lambda: rng.randbytes(rng.randint(0, 9)), lambda: None,
        lambda: True, lambda: False, lambda: torch.Size(rng.choice(((), (3,), (2, 0, 4)))),
        lambda: torch.float32, lambda: torch.device("cpu"),
        lambda: bytearray(b"ba"), lambda: 1 + 2j))()


def _obj(rng: random.Random, depth: int, tensors: list, made: list, left: list):
    """A random object of at most left[0] more parts (containers of 0-5, once in a while a
    dict or list of 1001 scalars)."""
    import torch
    left[0] -= 1
    k = rng.randrange(14) if depth < 4 and left[0] > 0 else rng.randrange(8)
    if k < 3:
        return _scalar(rng)
    if k < 6:
        if tensors and rng.random() < 0.5:
            t = _view(rng, rng.choice(tensors))
        else:
            t = _new_tensor(rng)
        tensors.append(t)
        if rng.random() < 0.1:
            t = t.detach().clone()
            t.ds_id = rng.randrange(100)  # a tensor with attributes of its own
        if rng.random() < 0.05 and t.dtype.is_floating_point:
            t = torch.nn.Parameter(t, requires_grad=rng.random() < 0.5)
        return t
    if k < 8 and made:
        return rng.choice(made)  # the same object twice
    if rng.random() < 0.01:
        out = {f"k{i}": i for i in range(1001)} if k < 10 else list(range(1001))
    elif k < 10:
        out = (dict if k == 8 else OrderedDict)(
            (rng.choice((f"k{i}", i, f"state.{i}")), _obj(rng, depth + 1, tensors, made, left))
            for i in range(rng.choice((0, 1, 2, 3, 5))))
    elif k < 12:
        out = [_obj(rng, depth + 1, tensors, made, left) for _ in range(rng.choice((0, 1, 2, 3, 5)))]
        out = tuple(out) if k == 11 else out
    else:
        items = {rng.choice(INTS) for _ in range(rng.randint(0, 4))} | {"s0"}
        out = set(items) if rng.random() < 0.9 else frozenset(items)
    made.append(out)
    return out


def torch_saved(rng: random.Random) -> tuple[bytes, str]:
    """A random object as torch.save writes it (protocol 2, sometimes 4)."""
    import torch
    obj = _obj(rng, 0, [], [], [rng.choice((4, 12, 40))])
    proto = 2 if rng.random() < 0.95 else 4
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=proto)
    return buf.getvalue(), f"torch.save protocol {proto} of {_describe(obj)}"


def _describe(obj, budget: int = 12) -> str:
    """A short sketch of obj (repr of big tensors and containers takes seconds)."""
    import torch
    left = [budget]

    def sketch(x) -> str:
        left[0] -= 1
        if left[0] < 0:
            return "..."
        if isinstance(x, torch.Tensor):
            return f"{type(x).__name__}({str(x.dtype)[6:]}{list(x.shape)}/{list(x.stride())})"
        if isinstance(x, dict):
            return f"{type(x).__name__}{{{', '.join(sketch(v) for v in list(x.values())[:4])}" \
                   f"{'' if len(x) <= 4 else f' +{len(x) - 4}'}}}"
        if isinstance(x, (list, tuple, set, frozenset)):
            return f"{type(x).__name__}[{', '.join(sketch(v) for v in list(x)[:4])}" \
                   f"{'' if len(x) <= 4 else f' +{len(x) - 4}'}]"
        return f"{x!r:.20}"
    return sketch(obj)
