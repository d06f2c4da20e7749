"""Pickles assembled opcode by opcode for the reader fuzzer (reader_fuzzing.py): what
torch.save writes (tensors, storages, containers, torch.Size, bytes) and, by chance, what it
never does: BUILD on a tensor, a storage or a Size, REDUCE and NEWOBJ of odd globals, deep
nesting, containers shared exponentially through the memo, views outside their storage.
"""
from __future__ import annotations

import random

from reader_grammar import INTS, GLOBALS, STRS, build_state, encode_ops, int_op, mutate_ops

_STORAGE_CLASSES = {"FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
                    "DoubleStorage": 8, "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2,
                    "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
                    "ComplexFloatStorage": 8}
_NONE = None


class _Asm:
    """Emits opcodes that leave one value each on the stack; keeps the memo and the
    storage records."""

    def __init__(self, rng: random.Random, marker: str) -> None:
        self.rng, self.marker = rng, marker
        self.ops: list = [("PROTO", 2)]
        self.memo = 0
        self.done: list[int] = []  # memo indexes of finished values (for sharing)
        self.storages: list[int] = []  # memo indexes of storages
        self.records: dict[str, bytes] = {}
        self.notes: list[str] = []

    def emit(self, *ops) -> None:
        self.ops += ops

    def put(self) -> int:
        self.emit(("BINPUT", self.memo) if self.memo < 256 else ("LONG_BINPUT", self.memo))
        self.memo += 1
        return self.memo - 1

    def get(self, i: int) -> None:
        self.emit(("BINGET", i) if i < 256 else ("LONG_BINGET", i))

    def value(self, depth: int = 0) -> None:
        rng = self.rng
        k = rng.randrange(16) if depth < 5 else rng.randrange(5)
        if k == 0:
            self.emit(int_op(rng.choice(INTS)))
        elif k == 1:
            self.emit(rng.choice((("BINFLOAT", rng.random()), ("NONE", _NONE),
                                  ("NEWTRUE", _NONE), ("BINUNICODE", rng.choice(STRS)))))
        elif k == 2:  # bytes, as protocol 2 writes them
            self.emit(("GLOBAL", "_codecs encode"), ("BINUNICODE", "ab\xff"),
                      ("BINUNICODE", rng.choice(("latin1", "latin1", "utf8"))),
                      ("TUPLE2", _NONE), ("REDUCE", _NONE))
        elif k in (3, 4, 5):
            self.tensor()
        elif k == 6 and self.done:
            self.get(rng.choice(self.done))
            return
        elif k == 7:
            self.emit(("GLOBAL", "torch Size"), ("MARK", _NONE),
                      *[int_op(rng.choice(INTS[:8])) for _ in range(rng.randint(0, 3))],
                      ("TUPLE", _NONE), ("TUPLE1", _NONE), ("REDUCE", _NONE))
        elif k in (8, 9, 14, 15):
            self.container(depth, rng.choice(("list", "dict", "tuple", "odict", "set", "dict")))
            return
        elif k == 10:
            self.odd()
        elif k == 11:
            self.build()
        elif k == 12:
            self.sharing()
        else:
            self.nesting()
        self.done.append(self.put())

    def container(self, depth: int, kind: str) -> None:
        rng, n = self.rng, self.rng.choice((0, 1, 2, 3, 4))
        if kind == "tuple":
            self.emit(("MARK", _NONE))
            for _ in range(n):
                self.value(depth + 1)
            self.emit(("TUPLE", _NONE))
            self.done.append(self.put())
            return
        if kind == "set":
            self.emit(("GLOBAL", "builtins set"), ("EMPTY_LIST", _NONE), ("MARK", _NONE),
                      *[int_op(rng.choice(INTS)) for _ in range(n)], ("APPENDS", _NONE),
                      ("TUPLE1", _NONE), ("REDUCE", _NONE))
            self.done.append(self.put())
            return
        if kind == "list":
            self.emit(("EMPTY_LIST", _NONE))
        elif kind == "dict":
            self.emit(("EMPTY_DICT", _NONE))
        else:
            self.emit(("GLOBAL", "collections OrderedDict"), ("EMPTY_TUPLE", _NONE),
                      ("REDUCE", _NONE))
        me = self.put()
        self.emit(("MARK", _NONE))
        for i in range(n):
            if kind != "list":
                self.emit(("BINUNICODE", f"k{i}") if rng.random() < 0.8 else int_op(i))
            self.value(depth + 1)
        self.emit(("APPENDS", _NONE) if kind == "list" else ("SETITEMS", _NONE))
        self.done.append(me)

    def storage(self) -> None:
        """A persistent id naming a record data/<key>, its size right or (rarely) wrong."""
        rng = self.rng
        if self.storages and rng.random() < 0.4:
            self.get(rng.choice(self.storages))
            return
        cls = rng.choice(tuple(_STORAGE_CLASSES)[:10] * 3 + tuple(_STORAGE_CLASSES))
        numel = rng.choice((0, 1, 2, 3, 4, 6, 8, 12))
        key = str(len(self.records))
        size = numel * _STORAGE_CLASSES[cls]
        if rng.random() < 0.05:
            size += rng.choice((-1, 1, _STORAGE_CLASSES[cls]))
            self.notes.append(f"record {key} of {max(size, 0)} bytes for {numel} elements")
        self.records[key] = bytes(rng.getrandbits(8) for _ in range(max(size, 0)))
        if rng.random() < 0.03:
            key, numel = rng.choice((("nope", numel), (key, 2**40), ("0", numel + 1)))
            self.notes.append(f"storage key {key!r} numel {numel}")
        self.emit(("MARK", _NONE), ("BINUNICODE", "storage"), ("GLOBAL", f"torch {cls}"),
                  ("BINUNICODE", key), ("BINUNICODE", "cpu"), int_op(numel),
                  ("TUPLE", _NONE), ("BINPERSID", _NONE))
        self.storages.append(self.put())

    def tensor(self) -> None:
        """_rebuild_tensor_v2(storage, offset, shape, stride, False, OrderedDict()); the view
        inside its storage as a rule, anything (negative, stride 0, huge) sometimes."""
        rng = self.rng
        self.emit(("GLOBAL", "torch._utils _rebuild_tensor_v2"), ("MARK", _NONE))
        self.storage()
        dims = rng.choice((0, 1, 1, 2, 3))
        shape = [rng.choice((0, 1, 2, 3)) for _ in range(dims)]
        stride, step = [], 1
        for d in reversed(shape):
            stride.insert(0, step)
            step *= max(d, 1)
        offset = rng.choice((0, 0, 0, 1, 2))
        if rng.random() < 0.15:
            where = rng.randrange(3)
            if where == 0 or not dims:
                offset = rng.choice(INTS)
            elif where == 1:
                shape[rng.randrange(dims)] = rng.choice(INTS)
            else:
                stride[rng.randrange(dims)] = rng.choice((0, -1, 2, 3) + INTS)
            self.notes.append(f"tensor offset {offset} shape {shape} stride {stride}")
        self.emit(int_op(offset), ("MARK", _NONE), *map(int_op, shape), ("TUPLE", _NONE),
                  ("MARK", _NONE), *map(int_op, stride), ("TUPLE", _NONE),
                  rng.choice((("NEWFALSE", _NONE), ("NEWTRUE", _NONE))),
                  ("GLOBAL", "collections OrderedDict"), ("EMPTY_TUPLE", _NONE),
                  ("REDUCE", _NONE), ("TUPLE", _NONE), ("REDUCE", _NONE))

    def build(self) -> None:
        """BUILD on a tensor, a storage, a Size or an OrderedDict (torch allows it on Tensor,
        Parameter and OrderedDict only, and on a Tensor it calls set_)."""
        rng = self.rng
        target = rng.randrange(4)
        if target == 1 and not self.storages:
            target = 0
        if target == 0:
            self.tensor()
        elif target == 1:
            self.get(rng.choice(self.storages))
        elif target == 2:
            self.emit(("GLOBAL", "torch Size"), ("MARK", _NONE), ("BININT1", 2),
                      ("TUPLE", _NONE), ("TUPLE1", _NONE), ("REDUCE", _NONE))
        else:
            self.emit(("GLOBAL", "collections OrderedDict"), ("EMPTY_TUPLE", _NONE),
                      ("REDUCE", _NONE))
        state = build_state(rng, self.marker)
        if rng.random() < 0.3 and self.storages:  # set_'s own arguments: a storage and a view
            state = [("MARK", _NONE), ("BINGET", self.storages[0] & 0xFF), int_op(0),
                     ("MARK", _NONE), int_op(rng.choice((1, 2, 4))), ("TUPLE", _NONE),
                     ("MARK", _NONE), int_op(1), ("TUPLE", _NONE), ("TUPLE", _NONE)]
        self.emit(*state, ("BUILD", _NONE))
        self.notes.append(f"BUILD on {('tensor', 'storage', 'Size', 'OrderedDict')[target]}")

    def odd(self) -> None:
        """A REDUCE or NEWOBJ of a global torch.save does not write so (or at all)."""
        rng = self.rng
        name = rng.choice(GLOBALS)
        args = [[], [("EMPTY_LIST", _NONE)], [int_op(rng.choice(INTS))],
                [("BINUNICODE", "echo hi")], [("EMPTY_DICT", _NONE)]][rng.randrange(5)]
        how = rng.choice(("REDUCE", "NEWOBJ"))
        self.emit(("GLOBAL", name), ("MARK", _NONE), *args, ("TUPLE", _NONE), (how, _NONE))
        self.notes.append(f"{how} {name}")

    def sharing(self) -> None:
        """k levels each holding the level below twice: 2^k paths through k + 1 objects."""
        k = self.rng.choice((3, 10, 25, 40, 64))
        leaf = self.rng.random() < 0.5
        if self.rng.random() < 0.5:  # lists: opened outermost first, filled innermost first
            first = self.memo
            for i in range(k, -1, -1):
                self.emit(("EMPTY_LIST", _NONE))
                self.put()
                if i:
                    self.emit(("MARK", _NONE))
            if leaf:
                self.tensor()
                self.emit(("APPEND", _NONE))
            for i in range(k):
                self.get(first + k - i)
                self.emit(("APPENDS", _NONE))
        else:  # tuples: each made of the one before, twice
            if leaf:
                self.tensor()
            else:
                self.emit(("EMPTY_DICT", _NONE))
            for _ in range(k):
                i = self.put()
                self.get(i)
                self.emit(("TUPLE2", _NONE))
        self.notes.append(f"shared {k} levels deep")

    def nesting(self) -> None:
        d = self.rng.choice((50, 199, 201, 1000) * 4 + (20000,))
        self.emit(*[("EMPTY_LIST", _NONE)] * d, *[("APPEND", _NONE)] * (d - 1))
        self.notes.append(f"lists nested {d} deep")


def assembled(rng: random.Random, marker: str) -> tuple[list, str]:
    """The records of a torch file whose data.pkl is assembled here, and a note."""
    from reader_fuzzing import Rec
    asm = _Asm(rng, marker)
    asm.value()
    asm.emit(("STOP", _NONE))
    if rng.random() < 0.1:
        asm.ops, note = mutate_ops(asm.ops, rng, marker=marker)
        asm.notes.append(note)
    recs = [Rec("archive/data.pkl", encode_ops(asm.ops)), Rec("archive/.format_version", b"1"),
            Rec("archive/.storage_alignment", b"64"), Rec("archive/byteorder", b"little")]
    recs += [Rec(f"archive/data/{k}", v) for k, v in asm.records.items()]
    recs.append(Rec("archive/version", b"3\n"))
    return recs, "; ".join(asm.notes) or "plain"
