"""Inputs for the differential fuzzer of mpitailor's torch-free reader (issue 40, part 3a).

Shared by tests/test_reader_fuzz.py (a short seeded sample in `make test`) and
bench/reader_fuzz.py (the long run). Input number `index` of seed `seed` is always the same
bytes (`make_input`), so a finding is replayed from two numbers. Three sources:

- real DeepSpeed and HF Trainer files of tests/ckpt_fixtures.py, mutated: the opcodes of
  their `data.pkl` (reader_grammar.mutate_ops) or their zip records (`_mutate_zip`);
- objects of random shape saved by torch.save itself (reader_grammar.torch_saved);
- pickles assembled opcode by opcode from a grammar, for what torch.save never writes
  (reader_asm.py).

Containers are built in memory (`build_zip`): the records of a torch file laid out as
torch lays them (data 64-byte aligned), with knobs to write them wrong.
"""
from __future__ import annotations

import io
import os
import random
import struct
import zipfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import reader_asm
import reader_grammar as grammar

# The file planted where a crafted pickle may point a storage (BUILD on the reader's own
# records): its bytes must never come back from a load of another file.
MARKER_PATH = "/tmp/mpitailor-reader-fuzz.marker"
MARKER = b"MPITAILOR-FUZZ-MARKER-0b5e"
# What the fixtures' files and mpitailor's loads of them allow (safeload's allow=).
DEEPSPEED, NUMPY = ("deepspeed",), ("deepspeed", "numpy")


@dataclass(frozen=True)
class Rec:
    """One zip record as build_zip writes it; crc/size override the true ones (to lie)."""
    name: str
    data: bytes
    method: int = zipfile.ZIP_STORED
    crc: int | None = None
    size: int | None = None


@dataclass(frozen=True)
class Input:
    kind: str            # "fixture-pickle", "fixture-zip", "torch-save", "opcodes"
    data: bytes          # the whole file
    note: str            # what was done to make it, one line
    allow: tuple[str, ...] = DEEPSPEED
    records: tuple[Rec, ...] = field(default=(), compare=False)  # for the shrinker


def plant_marker() -> None:
    """Write MARKER_PATH once (atomically: several fuzzing processes share it)."""
    if not os.path.isfile(MARKER_PATH) or Path(MARKER_PATH).read_bytes() != MARKER * 64:
        tmp = f"{MARKER_PATH}.{os.getpid()}"
        Path(tmp).write_bytes(MARKER * 64)
        os.replace(tmp, MARKER_PATH)


# ---- containers ------------------------------------------------------------------------

def build_zip(recs: list[Rec] | tuple[Rec, ...], *, tail: bytes = b"",
              cut: int | None = None) -> bytes:
    """A zip of these records in this order (stored unless told, local headers padded with
    torch's "FB" field so data starts on 64 bytes), central directory, end record; then
    `tail`; the whole cut to `cut` bytes if given."""
    out, central = bytearray(), bytearray()
    for r in recs:
        name = r.name.encode("utf-8", "surrogateescape")
        data = r.data
        if r.method == zipfile.ZIP_DEFLATED:
            c = zlib.compressobj(6, zlib.DEFLATED, -15)
            data = c.compress(data) + c.flush()
        crc = zlib.crc32(r.data) if r.crc is None else r.crc
        usize = len(r.data) if r.size is None else r.size
        csize = len(data) if r.size is None else r.size
        start = len(out) + 30 + len(name) + 4
        pad = -start % 64
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        head_at = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0x0800, r.method, 0, 0, crc,
                           csize & 0xFFFFFFFF, usize & 0xFFFFFFFF, len(name), len(extra))
        out += name + extra + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0x0800, r.method,
                               0, 0, crc, csize & 0xFFFFFFFF, usize & 0xFFFFFFFF, len(name),
                               0, 0, 0, 0, 0, head_at) + name
    n = len(recs)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), len(out), 0)
    whole = bytes(out + central + end) + tail
    return whole if cut is None else whole[:cut]


def read_zip(data: bytes) -> list[Rec]:
    """The records of a zip (a torch file), in order."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [Rec(i.filename, z.read(i)) for i in z.infolist()]


# ---- seeds: the real files ---------------------------------------------------------------

@dataclass(frozen=True)
class Seed:
    label: str
    records: tuple[Rec, ...]
    ops: tuple  # data.pkl as (opcode name, arg) pairs
    allow: tuple[str, ...]

    @property
    def pickle_index(self) -> int:
        return next(i for i, r in enumerate(self.records) if r.name.endswith("/data.pkl"))


# Fixtures of tests/ckpt_fixtures.py whose files seed the mutations: ZeRO-3 fp32 and bf16,
# ZeRO-2 (fragment_address), the HF Trainer's side files (numpy RNG states, the scheduler).
SEED_FIXTURES = ("w2_fp32_one", "w3_bf16_decay_tied_frozen", "s2_w2_bf16_per_layer",
                 "hf_w2_fp32")


def seed_files(fixture_dirs: list[Path]) -> list[Path]:
    """Rank 0's model and optimizer states and the HF side files of each fixture dir (of
    one saved step)."""
    files = []
    for d in fixture_dirs:
        for pat in ("*zero_pp_rank_0_*_model_states.pt", "*zero_pp_rank_0_*_optim_states.pt",
                    "mp_rank_00_model_states.pt"):
            files += sorted(d.glob(f"*/{pat}"))[:1] or sorted(d.glob(f"*/*/{pat}"))[:1]
        for pat in ("*/rng_state_0.pth", "*/scheduler.pt"):
            files += sorted(d.glob(pat))[:1]
    return sorted(set(files))


def load_seeds(files: list[Path]) -> list[Seed]:
    out = []
    for f in files:
        recs = tuple(read_zip(f.read_bytes()))
        pkl = next(r.data for r in recs if r.name.endswith("/data.pkl"))
        allow = NUMPY if f.name.startswith("rng_state") else DEEPSPEED
        out.append(Seed(f"{f.parent.parent.name[:28]}/{f.parent.name}/{f.name}", recs,
                        tuple(grammar.parse_ops(pkl)), allow))
    return out


# ---- mutations of real files ---------------------------------------------------------------

def _with_pickle(seed: Seed, ops, rng: random.Random) -> list[Rec]:
    recs = list(seed.records)
    i = seed.pickle_index
    recs[i] = replace(recs[i], data=grammar.encode_ops(ops))
    return recs


def _mutate_pickle(seed: Seed, seeds: list[Seed], rng: random.Random) -> Input:
    ops, notes = list(seed.ops), []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        ops, note = grammar.mutate_ops(ops, rng, donors=[s.ops for s in seeds])
        notes.append(note)
    recs = _with_pickle(seed, ops, rng)
    return Input("fixture-pickle", build_zip(recs), f"{seed.label}: {'; '.join(notes)}",
                 seed.allow, tuple(recs))


def _storage_names(recs) -> list[int]:
    return [i for i, r in enumerate(recs) if "/data/" in r.name]


def _mutate_zip(seed: Seed, seeds: list[Seed], rng: random.Random) -> Input:
    """One change to the container: duplicated (also under a name that differs in case only,
    which torch's miniz finds ignoring case), dropped, renamed (also with a NUL, where
    zipfile ends a name and torch does not), resized, compressed or mislabelled records, a
    cut or extended file."""
    recs, pi = list(seed.records), seed.pickle_index
    pick = rng.choice([pi] * 2 + _storage_names(recs) or [pi])
    r = recs[pick]
    what = rng.choice(("dup-first", "dup-last", "dup-case", "drop", "rename", "nul-name",
                       "resize", "crc", "compress", "past-end", "cut", "tail", "reorder",
                       "archive", "flip"))
    cut, tail = None, b""
    if what in ("dup-first", "dup-last", "dup-case"):
        other = grammar.encode_ops(grammar.mutate_ops(list(seed.ops), rng)[0]) \
            if pick == pi else bytes(rng.getrandbits(8) for _ in range(len(r.data)))
        archive, _, rest = r.name.partition("/")
        name = f"{archive}/{rest.upper()}" if what == "dup-case" else r.name
        recs.insert(pick if what == "dup-first" else pick + 1, Rec(name, other))
    elif what == "nul-name":  # zipfile reads `name`, torch `name\0x`: another record for each
        recs[pick] = replace(r, name=r.name + "\0" + rng.choice(("x", "", ".pkl")))
    elif what == "drop":
        del recs[pick]
    elif what == "rename":
        recs[pick] = replace(r, name=rng.choice(
            [x.name for x in recs] + [r.name + "x", r.name.rsplit("/", 1)[0] + "/99",
                                      "other/" + r.name.split("/", 1)[-1]]))
    elif what == "resize":
        d = rng.choice((-8, -4, -2, -1, 1, 2, 4, 8))
        recs[pick] = replace(r, data=r.data[:d] if d < 0 else r.data + bytes(d))
    elif what == "crc":
        recs[pick] = replace(r, crc=zlib.crc32(r.data) ^ (1 << rng.randrange(32)))
    elif what == "compress":
        recs[pick] = replace(r, method=zipfile.ZIP_DEFLATED)
    elif what == "past-end":
        recs.append(recs.pop(pick))
        recs[-1] = replace(recs[-1], size=len(recs[-1].data) + rng.choice((1, 64, 1 << 20)))
    elif what == "archive":
        new = rng.choice(("archive", "x", "", "a/b"))
        recs = [replace(x, name=new + "/" + x.name.split("/", 1)[-1]) for x in recs]
    elif what == "reorder":
        rng.shuffle(recs)
    whole = build_zip(recs)
    if what == "cut":
        cut = rng.randrange(len(whole))
    elif what == "tail":
        tail = rng.choice((b"\0" * 7, whole[-22:], b"PK\x05\x06" + bytes(18)))
    elif what == "flip":
        whole = bytearray(whole)
        where = rng.choice((rng.randrange(len(whole)), len(whole) - rng.randrange(1, 120)))
        whole[where] ^= 1 << rng.randrange(8)
        return Input("fixture-zip", bytes(whole), f"{seed.label}: flip byte {where}",
                     seed.allow)
    return Input("fixture-zip", build_zip(recs, tail=tail, cut=cut),
                 f"{seed.label}: {what} {r.name}" + (f" cut {cut}" if cut else ""),
                 seed.allow, tuple(recs) if cut is None and not tail else ())


# ---- one input from two numbers ---------------------------------------------------------

KINDS = ("fixture-pickle", "fixture-zip", "torch-save", "opcodes")
_WEIGHTS = (45, 10, 15, 30)


def make_input(seed: int, index: int, seeds: list[Seed]) -> Input:
    """Input number `index` of the run seeded `seed`: the same bytes every time."""
    rng = random.Random(f"reader-fuzz:{seed}:{index}")
    kind = rng.choices(KINDS, _WEIGHTS)[0]
    if kind in ("fixture-pickle", "fixture-zip") and seeds:
        # Seeds by the inverse of their pickles' length: every load of a pickle of 2,000
        # opcodes costs ~10 ms in the two pure-Python unpicklers, one of 50 ~1 ms.
        base = rng.choices(seeds, [1 / (500 + len(s.ops)) for s in seeds])[0]
        return (_mutate_pickle if kind == "fixture-pickle" else _mutate_zip)(base, seeds, rng)
    if kind == "torch-save":
        data, note = grammar.torch_saved(rng)
        return Input(kind, data, note)
    recs, note = reader_asm.assembled(rng, MARKER_PATH)
    return Input("opcodes", build_zip(recs), note, DEEPSPEED, tuple(recs))
