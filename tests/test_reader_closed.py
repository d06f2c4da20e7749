"""The torch-free reader is closed by construction (issue 40, U1-U7, W2): what it builds are
values, every tensor lies inside its own record, opaque objects come from an allow-list.

Each case is a crafted file: a real torch.save whose data.pkl is rewritten opcode by opcode,
the way an attacker would; the reader must refuse it in one line (CheckpointError) or read
it right, never hand back bytes from outside the file's records. The end-to-end case runs
the real CLI on a real DeepSpeed save carrying the crafted model states.
"""
from __future__ import annotations

import argparse
import io
import pickle
import pickletools
import resource
import struct
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from merging import run_cli

from mpitailor.errors import CheckpointError
from mpitailor.formats.torch import opaque, zip_write
from mpitailor.formats.torch.rebuild import Size
from mpitailor.formats.torch.safeload import MAX_OBJECTS, load, load_with_globals
from mpitailor.formats.torch.tensorref import Storage, Tensor

SECRET = b"SECRET-8d1c-" * 8


# ---- crafting --------------------------------------------------------------------------

def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def records(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def rezip(recs: dict[str, bytes] | list[tuple[str, bytes]], path: Path) -> Path:
    """The records as a stored zip (torch.load reads any such zip as a torch file)."""
    items = list(recs.items() if isinstance(recs, dict) else recs)
    archive = items[0][0].partition("/")[0]
    if not any(n.endswith("version") for n, _ in items):  # torch refuses a file without
        items.append((f"{archive}/version", b"3\n"))
    with zipfile.ZipFile(path, "w") as z:
        for name, data in items:
            z.writestr(name, data)
    return path


def pickle_of(data: bytes) -> bytes:
    return next(d for n, d in records(data).items() if n.endswith("/data.pkl"))


def with_pickle(data: bytes, pkl: bytes, path: Path) -> Path:
    recs = {n: pkl if n.endswith("/data.pkl") else d for n, d in records(data).items()}
    return rezip(recs, path)


def after(pkl: bytes, opname: str, nth: int = 0) -> int:
    """The offset just past the nth `opname` opcode (and the BINPUT that memoizes it)."""
    ops = list(pickletools.genops(pkl))
    hits = [i for i, (op, _, _) in enumerate(ops) if op.name == opname]
    i = hits[nth] + 1
    if i < len(ops) and ops[i][0].name in ("BINPUT", "LONG_BINPUT"):
        i += 1
    return ops[i][2]


def uni(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def state_dict_ops(**fields) -> bytes:
    """NONE, {fields}, TUPLE2: the (state, slotstate) form BUILD sets slots with."""
    out = b"N}"
    for k, v in fields.items():
        out += uni(k) + (uni(v) if isinstance(v, str) else b"J" + struct.pack("<i", v)) + b"s"
    return out + b"\x86"


def refused(path: Path, *words: str, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        load(path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.fixture
def secret(tmp_path) -> Path:
    p = tmp_path / "secret"
    p.write_bytes(SECRET)
    return p


# ---- U1-U3: BUILD on the reader's own records ------------------------------------------

@pytest.mark.parametrize("field", ["path", "numel", "offset", "dtype"])
def test_build_on_a_storage_is_refused(tmp_path, secret, field):
    """U1: BUILD right after the storage's persistent id, setting its slots (the file the
    bytes come from, their offset or count) before the tensor is made of it."""
    data = saved({"w": torch.zeros(16)})
    pkl = pickle_of(data)
    value = {"path": str(secret), "numel": 64, "offset": 0, "dtype": "u8"}[field]
    at = after(pkl, "BINPERSID")
    pkl = pkl[:at] + state_dict_ops(**{field: value}) + b"b" + pkl[at:]
    refused(with_pickle(data, pkl, tmp_path / "x.pt"), "BUILD on Storage")


@pytest.mark.parametrize("field,value", [("storage_offset", -100), ("storage_offset", 90000),
                                         ("shape", "x")])
def test_build_on_a_tensor_is_refused(tmp_path, field, value):
    """U2: BUILD on the tensor after its bounds were checked."""
    data = saved({"w": torch.zeros(16)})
    pkl = pickle_of(data)
    at = after(pkl, "REDUCE", 1)  # the first makes the hooks' OrderedDict
    pkl = pkl[:at] + state_dict_ops(**{field: value}) + b"b" + pkl[at:]
    refused(with_pickle(data, pkl, tmp_path / "x.pt"), "BUILD on Tensor")


def test_build_on_a_stand_in_class_is_refused_and_changes_nothing(tmp_path):
    """U3: BUILD on the torch.Size class itself (its global name set to sys.exit): refused,
    and the process-wide stand-in keeps its name (and no stand-in class takes a setattr)."""
    data = saved({"s": torch.Size([2, 3])})
    pkl = pickle_of(data)
    at = after(pkl, "GLOBAL")  # torch Size, the first global
    pkl = pkl[:at] + state_dict_ops(global_name="sys.exit") + b"b" + pkl[at:]
    refused(with_pickle(data, pkl, tmp_path / "x.pt"), "BUILD on")
    assert Size.global_name == "torch.Size"
    with pytest.raises(AttributeError):
        opaque.stand_in("pkg.Thing").global_name = "sys.exit"


def test_records_are_read_only_values():
    s = Storage("fp32", 4, data=bytes(16))
    t = Tensor(s, 0, (4,), (1,))
    for obj, field, value in ((s, "path", "/etc/passwd"), (s, "offset", 0), (t, "shape", (9,)),
                              (t, "storage_offset", 3), (t, "storage", s)):
        with pytest.raises(AttributeError):
            setattr(obj, field, value)
    with pytest.raises(ValueError, match="outside its storage"):
        Tensor(s, 3, (2,), (1,))
    with pytest.raises(ValueError):
        s.read(8, 16)  # past its end
    # Other picklers (MPI between ranks) carry them by their fields, checked again.
    again = pickle.loads(pickle.dumps(t))
    assert (again.shape, again.storage.data) == ((4,), bytes(16))


# ---- U4: opaque objects from an allow-list ----------------------------------------------

CALLS = ["cProfile.run", "profile.run", "pkgutil.resolve_name", "_posixsubprocess.fork_exec",
         "pydoc.pipepager", "_operator.attrgetter", "idlelib.run.exec", "os.system",
         "builtins.eval", "__builtin__.eval", "numpy.load", "torch.load", "copyreg._reconstructor"]


def reduce_of(full: str, arg: str) -> bytes:
    module, _, name = full.rpartition(".")
    return (b"\x80\x02}X\x01\x00\x00\x00xc" + module.encode() + b"\n" + name.encode() + b"\n"
            + uni(arg) + b"\x85Rs.")


@pytest.mark.parametrize("name", CALLS)
def test_globals_that_run_code_are_refused_in_client_state(tmp_path, name):
    """U4: the deny-list let these through as stand-ins; the allow-list refuses each, by
    name, also where client state (opaque objects) is allowed."""
    path = rezip({"archive/data.pkl": reduce_of(name, "id")}, tmp_path / "x.pt")
    msg = refused(path, "refused to load", opaque_ok=True)
    assert name.replace("__builtin__", "builtins") in msg or "calls" in msg, msg


def test_a_class_of_the_script_is_carried_as_an_instance_but_never_called(tmp_path):
    """A plain object of the training script's own class (`__main__.RunNotes`: NEWOBJ +
    BUILD, as a dataclass pickles) is a stand-in; the same class called (a REDUCE) is
    refused, naming the class and --safe-globals. A class of any other module needs
    --safe-globals: a name alone cannot tell a user's dataclass from an installed package's
    class whose __new__ runs code (sympy's Poly evaluates its string argument when built)."""
    def inst(module: str, name: str, arg: bytes = b"") -> bytes:
        return (b"\x80\x02}X\x01\x00\x00\x00xc" + module.encode() + b"\n" + name.encode()
                + b"\n(" + arg + b"t\x81}" + uni("lr") + b"G?\xb9\x99\x99\x99\x99\x99\x9asbs.")
    obj = load(rezip({"archive/data.pkl": inst("__main__", "RunNotes")}, tmp_path / "a.pt"),
               opaque_ok=True)
    assert obj["x"].lr == 0.1 and type(obj["x"]).global_name == "__main__.RunNotes"
    call = rezip({"archive/data.pkl": reduce_of("__main__.RunNotes", "rm -rf")},
                 tmp_path / "b.pt")
    refused(call, "it calls __main__.RunNotes", "--safe-globals __main__.RunNotes",
            opaque_ok=True)
    refused(rezip({"archive/data.pkl": inst("__main__", "RunNotes")}, tmp_path / "c.pt"),
            "__main__.RunNotes")  # not in an optimizer file (no client state there)
    for module, name in (("mytrain.notes", "RunNotes"), ("sympy.polys.polytools", "Poly")):
        gadget = rezip({"archive/data.pkl": inst(module, name, uni("x"))}, tmp_path / "d.pt")
        refused(gadget, f"it pickles {module}.{name} outside", f"--safe-globals {module}.{name}",
                opaque_ok=True)


def test_real_client_state_is_carried(tmp_path):
    """What training scripts save in client_state: Namespace, numpy scalars and dtypes,
    arrays; and bytearray (W2), which torch's weights-only loader accepts too."""
    state = {"args": argparse.Namespace(lr=0.1, tag="x"), "best": np.float64(0.25),
             "i": np.int64(3), "dt": np.dtype("float32"), "arr": np.arange(3),
             "raw": bytearray(b"ab\xff")}
    path = tmp_path / "c.pt"
    path.write_bytes(saved(state))
    obj, names = load_with_globals(path, opaque_ok=True)
    assert obj["raw"] == bytearray(b"ab\xff") and obj["args"].lr == 0.1
    assert "argparse.Namespace" in names and "builtins.bytearray" in names
    out = tmp_path / "w.pt"
    zip_write.write_torch_file(out, obj)
    assert pickle_of(out.read_bytes()) == pickle_of(path.read_bytes())


# ---- U5: shared containers ---------------------------------------------------------------

def test_exponential_sharing_is_refused_fast_and_small(tmp_path):
    """U5: 40 levels of lists, each holding the one below twice: 2**40 objects once
    unshared, 1.7 KB of pickle. Refused by the object bound, in well under a second of
    work and without growing the process."""
    pkl = b"\x80\x02]q\x00"
    for i in range(1, 41):
        pkl += b"]q" + bytes([i]) + b"(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"e"
    pkl += b"."
    path = rezip({"archive/data.pkl": pkl}, tmp_path / "x.pt")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(path, f"over {MAX_OBJECTS} objects")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB


def test_a_file_of_a_million_containers_is_refused_as_they_are_made(tmp_path):
    """2**20 + 1 empty dicts in one list (3 MB of pickle): counted as the unpickler makes
    them, refused there (it was refused after the whole load and a walk, at ~220 MB of
    growth and 4 s); 2**20 of them are still read. And one int referenced 2**20 + 1 times
    (nothing made but the list) is refused by what it describes."""
    from mpitailor.formats.torch.pickle_read import MAX_MADE
    path = rezip({"archive/data.pkl": b"\x80\x02](" + b"}" * (MAX_MADE + 1) + b"e."},
                 tmp_path / "x.pt")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(path, f"makes over {MAX_MADE} objects")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB
    path = rezip({"archive/data.pkl": b"\x80\x02](" + b"}" * (MAX_MADE - 2) + b"e."},
                 tmp_path / "y.pt")
    assert len(load(path)) == MAX_MADE - 2
    same = b"\x80\x02](J\x07\x00\x00\x00q\x01" + b"h\x01" * MAX_OBJECTS + b"e."
    refused(rezip({"archive/data.pkl": same}, tmp_path / "z.pt"), f"over {MAX_OBJECTS} objects")


def test_a_refusal_never_shows_all_of_what_the_file_shares(tmp_path):
    """A tuple shared 2**40 times given to NEWOBJ: the refusal's message took its full repr
    (582 s and 7.7 GB before a MemoryError; the fuzzer's hang, seed 3 input 170969). The
    message now shows a bounded repr."""
    pkl = b"\x80\x02}q\x00" + b"".join(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q"
                                     + bytes([i + 1]) for i in range(40)) + b"h(\x81."
    path = rezip({"archive/data.pkl": pkl}, tmp_path / "x.pt")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    msg = refused(path, "a new object of ((((...)")
    assert len(msg) < 400 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000


def test_a_container_that_holds_itself_is_refused(tmp_path):
    pkl = b"\x80\x02]q\x00h\x00a."  # a list appended to itself
    refused(rezip({"archive/data.pkl": pkl}, tmp_path / "x.pt"), "holds itself")


# ---- U6: views ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape,stride,offset,words", [
    ((100000,), (0,), 0, "elements over a storage of 1"),
    ((10 ** 12,), (0,), 0, "elements over a storage of 1"),
    ((), (), 5, "outside its storage"),          # a 0-d view past its storage
    ((2,), (1,), 0, "elements over a storage of 1"),
    ((1,), (1,), 1, "outside its storage"),
    ((1,), (-1,), 0, "negative"),
])
def test_views_outside_their_storage_are_refused(tmp_path, shape, stride, offset, words):
    """U6: a tensor's view is checked with its real strides: stride 0 over one element,
    a 0-d tensor whose offset lies past its storage."""
    t = torch.zeros(1)
    data = saved({"t": t, "pad": torch.arange(64.0)})  # bytes after t's record to leak
    pkl = pickle_of(data)
    ops = list(pickletools.genops(pkl))
    # rewrite the first tensor's (offset, shape, stride) arguments
    first = next(i for i, (op, _, _) in enumerate(ops) if op.name == "BINPERSID")
    start = ops[first + 2][2] if ops[first + 1][0].name == "BINPUT" else ops[first + 1][2]
    end = next(pos for op, _, pos in ops[first:] if op.name == "NEWFALSE")

    def tup(xs):
        return b"(" + b"".join(b"J" + struct.pack("<i", x) if -2**31 <= x < 2**31
                               else b"\x8a\x08" + struct.pack("<q", x) for x in xs) + b"t"
    pkl = pkl[:start] + b"J" + struct.pack("<i", offset) + tup(shape) + tup(stride) + pkl[end:]
    refused(with_pickle(data, pkl, tmp_path / "x.pt"), words)


def test_strided_views_read_right(tmp_path):
    """An honest non-contiguous view (a transpose) reads as torch reads it."""
    base = torch.arange(12.0).reshape(3, 4)
    path = tmp_path / "t.pt"
    path.write_bytes(saved({"t": base.t(), "s": base[1:, 2:]}))
    got = load(path)
    for k, want in (("t", base.t()), ("s", base[1:, 2:])):
        assert np.array_equal(got[k].values(), want.contiguous().numpy().reshape(-1))


# ---- U7: the zip ------------------------------------------------------------------------

@pytest.mark.parametrize("twice", ["archive/data.pkl", "archive/data/0"])
def test_two_records_of_one_name_are_refused(tmp_path, twice):
    """U7: torch reads the first of two same-named records, zipfile the last."""
    recs = list(records(saved({"w": torch.ones(4)})).items())
    dup = next(r for r in recs if r[0] == twice)
    if twice.endswith("data.pkl"):
        dup = (twice, pickle.dumps({"w": 1}, protocol=2))
    else:
        dup = (twice, bytes(len(dup[1])))
    path = rezip(recs + [dup], tmp_path / "x.pt")
    refused(path, "two records named")


@pytest.mark.parametrize("other", ["archive/DATA.PKL", "archive/DATA/0", "archive/BYTEORDER"])
def test_records_whose_names_differ_only_in_case_are_refused(tmp_path, other):
    """Attack 03/09 (helper, 2026-11-28): torch's miniz finds a record ignoring case, so a
    second `DATA.PKL` (a payload), `DATA/0` (other tensor bytes) or `BYTEORDER` (big: torch
    swaps bytes) was what torch read while mpitailor read the real one and passed it on."""
    recs = list(records(saved({"w": torch.ones(4)})).items())
    real = dict(recs)[other.lower()]
    path = rezip(recs + [(other, b"big" if other.endswith("BYTEORDER") else bytes(len(real)))],
                 tmp_path / "x.pt")
    refused(path, "upper case")


def test_a_record_name_with_a_nul_is_refused(tmp_path):
    """Attack 03 (NUL variant): zipfile ends a name at its first NUL and torch does not, so
    `data.pkl\\0` was mpitailor's data.pkl and `DATA.PKL` torch's, every time."""
    recs = list(records(saved({"w": torch.ones(4)})).items())
    path = rezip(recs, tmp_path / "x.pt")
    raw = path.read_bytes()
    at = raw.rindex(b"archive/byteorder")  # its central directory entry: the name's last byte
    path.write_bytes(raw[:at + len(b"archive/byteorde")] + b"\0" + raw[at + len(b"archive/byteorder"):])
    refused(path, "NUL")


def test_overlapping_records_are_refused(tmp_path):
    """Record 1's central-directory entry pointed at record 0's local header (names of one
    length): one storage's bytes would be another's."""
    data = bytearray(saved({"a": torch.ones(4), "b": torch.zeros(4)}))
    z = zipfile.ZipFile(io.BytesIO(bytes(data)))
    a = z.getinfo("archive/data/0")
    entry = bytes(data).find(b"archive/data/1", z.start_dir) - 46  # its central header
    assert data[entry: entry + 4] == b"PK\x01\x02"
    struct.pack_into("<I", data, entry + 42, a.header_offset)
    path = tmp_path / "x.pt"
    path.write_bytes(bytes(data))
    refused(path, "overlap")


# ---- End to end: the CRITICAL case, through the real CLI --------------------------------

def test_recover_never_copies_another_file_into_its_output(ckpt_copy, tmp_path, secret):
    """U1 end to end: a real partial-save run whose newest model states carry a BUILD that
    points a storage at a secret file: recover says so in one line and skips that save (a
    damaged partial save is skipped, by the recovery rules), and the secret is nowhere in
    what it wrote."""
    root = ckpt_copy("w2_parity")
    victim = sorted((root / "global_step8").glob("*model_states.pt"))[0]
    data = victim.read_bytes()
    pkl = pickle_of(data)
    at = after(pkl, "BINPERSID")
    pkl = pkl[:at] + state_dict_ops(path=str(secret)) + b"b" + pkl[at:]
    recs = [(n, pkl if n.endswith("/data.pkl") else d) for n, d in records(data).items()]
    rezip(recs, victim)
    out = tmp_path / "out"
    r = run_cli(["recover", str(root), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "BUILD on Storage" in r.stderr, r.stderr
    assert f"skipping global_step8: {victim}" in r.stderr, r.stderr
    assert (out / "latest").read_text() == "global_step6"
    for p in tmp_path.rglob("*"):
        if p.is_file() and p != secret:
            assert SECRET[:12] not in p.read_bytes(), p


# ---- W1: the writer, and what inspect says ----------------------------------------------

@pytest.mark.parametrize("n", [1, 999, 1000, 1001, 2000, 2001])
def test_dicts_and_lists_batch_as_torch_save_does(n):
    """W1: the C pickler (torch.save's) batches plain dicts and lists differently from the
    pure one around multiples of 1000 items; the writer's bytes follow torch.save's."""
    from torch_files import as_refs

    from mpitailor.formats.torch.pickle_write import dumps
    for obj in ({f"k{i}": i for i in range(n)}, list(range(n)),
                OrderedDict((i, [i]) for i in range(n))):
        assert dumps(as_refs(obj))[0] == pickle_of(saved(obj)), (n, type(obj))


def test_inspect_lists_the_globals_a_save_carries(ckpt):
    from ckpt_fixtures import build
    r = run_cli(["inspect", str(build("w2_client_state") / "global_step8")], {}, ranks=1)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("carries"))
    for name in ("__main__.RunNotes", "argparse.Namespace", "numpy.dtype"):
        assert name in line, line


# ---- Found by an hour of attack on the closed reader, each a standing case --------------

def glob_(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def top(*pairs: bytes) -> bytes:
    """A protocol-2 pickle of one dict with these (key + value) pairs."""
    return b"\x80\x02}" + b"".join(p + b"s" for p in pairs) + b"."


def test_rebuild_from_type_names_only_the_tensor_rebuild(tmp_path):
    """torch's _rebuild_from_type_v2 calls its first argument: carried as a stand-in with
    another function there (sympy.sympify, which evaluates a string), the output made
    DeepSpeed's own loader call it. Refused unless it rebuilds a tensor of a tensor type."""
    call = (glob_("torch._tensor", "_rebuild_from_type_v2") + b"(" + glob_("__main__", "run")
            + glob_("torch", "Tensor") + uni("__import__('os')") + b"\x85}tR")
    path = rezip({"archive/data.pkl": top(uni("x") + call)}, tmp_path / "x.pt")
    refused(path, "_rebuild_from_type_v2 of something other than a tensor", opaque_ok=True)


def test_a_zip_whose_central_directory_is_not_where_its_end_record_says(tmp_path):
    """zipfile shifts every offset by the difference (data before a zip), torch's miniz does
    not: one file, two readings. Refused."""
    path = tmp_path / "x.pt"
    path.write_bytes(b"\0" * 64 + saved({"w": torch.ones(2)}))
    refused(path, "central directory is not where the end record says")


def test_a_shared_tensor_is_copied_once_and_views_are_bounded(tmp_path):
    from mpitailor.formats.torch.rawio import copied
    t = torch.arange(8.0)
    path = tmp_path / "s.pt"
    path.write_bytes(saved({"a": [t, t], "b": t}))
    obj = load(path)
    with open(path, "rb") as f:
        out = copied(obj, f.fileno())
    assert out["a"][0] is out["a"][1] is out["b"] and out["b"] is not obj["b"]
    # 3000 distinct views of one 256 KiB storage, each of all of it: 750 MiB to copy
    big = torch.zeros(1 << 16)
    path.write_bytes(saved([big.view(-1) for _ in range(3000)]))
    refused(path, "view", "bytes of storages that hold")


def test_stand_ins_as_dict_keys_hash_apart():
    """Every stand-in of a class hashed alike: 20000 of them as dict keys cost 80 s of
    comparisons. Their hashes follow what the pickle gave them."""
    cls = opaque.stand_in("deepspeed.utils.tensor_fragment.fragment_address")
    keys = [cls.__new__(cls, i) for i in range(1000)]
    assert len({hash(k) for k in keys}) == 1000
    assert hash(cls.__new__(cls, 5)) == hash(keys[5]) and cls.__new__(cls, 5) == keys[5]


def test_bytearray_of_a_size_is_refused(tmp_path):
    """bytearray(3 * 10**9) from 60 bytes of pickle: torch would allocate it."""
    pkl = top(uni("b") + glob_("builtins", "bytearray") + b"\x8a\x05\x00\x5e\xd0\xb2\x00\x85R")
    refused(rezip({"archive/data.pkl": pkl}, tmp_path / "x.pt"), "bytearray of something")


@pytest.mark.parametrize("value", [b"X\x01\x00\x00\x002", b"G@\x00\x00\x00\x00\x00\x00\x00",
                                   b"\x88", b"N"])
def test_counters_of_the_wrong_type_are_one_line(ckpt_copy, value):
    """global_steps as "2", 2.0, True or None in a real model-states file: one line, rc 2,
    on inspect (it was a traceback, or a silent exit 0)."""
    root = ckpt_copy("w2_fp32_one")
    for f in sorted((root / "global_step10").glob("*model_states.pt")):
        data = f.read_bytes()
        pkl = pickle_of(data)
        assert pkl.endswith(b".")
        recs = [(n, pkl[:-1] + uni("global_steps") + value + b"s." if n.endswith("data.pkl")
                 else d) for n, d in records(data).items()]
        rezip(recs, f)
    r = run_cli(["inspect", str(root / "global_step10")], {})
    assert r.returncode == 2 and "global_steps is" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_file_naming_hundreds_of_globals_is_refused(tmp_path):
    """Each global a stand-in class the process keeps: 100000 of them, 263 MB."""
    pkl = b"\x80\x02]" + b"(" + b"".join(glob_("__main__", f"C{i}") + b")\x81"
                                      for i in range(300)) \
        + b"e."
    refused(rezip({"archive/data.pkl": pkl}, tmp_path / "x.pt"), "different globals",
            opaque_ok=True)


def test_what_tensors_and_ordered_dicts_carry_is_walked_too(tmp_path):
    """A tensor's attributes (_rebuild_from_type_v2's state) and an OrderedDict's (BUILD)
    nested 300 deep, as torch.save writes them: refused at load, not a RecursionError when
    written."""
    deep: list = []
    for _ in range(300):
        deep = [deep]
    t = torch.zeros(2)
    t.ds_id = deep
    od = OrderedDict(w=torch.zeros(1))
    od._metadata = deep
    for name, obj in (("t", {"t": t}), ("o", od)):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(saved(obj))
        refused(path, "nested over 200")


@pytest.mark.parametrize("pkl,words", [
    (top(uni("x") + b"]" + glob_("builtins", "set") + b"a"), "keeps the global builtins.set as a value"),
    (top(uni("x") + glob_("_codecs", "encode")), "keeps the global _codecs.encode as a value"),
    (top(uni("x") + glob_("collections", "OrderedDict") + b")R}" + uni("__setstate__")
         + b"K\x01sb"), "BUILD on OrderedDict"),
    (top(uni("x") + glob_("", "x")), "not module.Name"),
    (top(uni("x") + glob_("evilpkg", "os.system")), "not module.Name"),
])
def test_globals_kept_as_values_and_odd_names_are_refused(tmp_path, pkl, words):
    """Written back, a class or function kept as a value named a global of Python's or
    mpitailor's; a dotted name was split at another dot (evilpkg.os.system)."""
    refused(rezip({"archive/data.pkl": pkl}, tmp_path / "x.pt"), words, opaque_ok=True)


# ---- Found by the differential fuzzer (bench/reader_fuzz.py), each a standing case -------

@pytest.mark.parametrize("pkl,words", [
    (top(uni("x") + glob_("builtins", "frozenset") + b"]\x85R"), "builtins.frozenset"),
    (top(uni("x") + glob_("torch", "device") + uni("echo hi") + b"\x85R"), "torch.device"),
    (top(uni("x") + glob_("torch", "Tensor") + b"}\x85R"), "torch.Tensor"),
    (top(uni("x") + glob_("torch._utils", "_rebuild_parameter") + b"]\x89}\x87R"),
     "torch._utils._rebuild_parameter"),
])
def test_what_torch_refuses_to_call_is_refused(tmp_path, pkl, words):
    """torch's weights-only loader refuses these calls (frozenset is not on its list; a
    device, a tensor or a parameter of arguments torch rejects): mpitailor refuses every
    call of them rather than carry what torch would not build."""
    refused(rezip({"archive/data.pkl": pkl}, tmp_path / "x.pt"), words, opaque_ok=True)


def test_views_past_2_63_and_metadata_that_is_not_a_dict(tmp_path):
    """A stride of 2**64 (torch cannot unpack it); metadata -1 (torch asserts a dict)."""
    data = saved({"t": torch.zeros(1)})
    pkl = pickle_of(data)
    stride = b"K\x01\x85q\t"  # (1,), memoized as 9: the second one-tuple of the tensor
    assert pkl.count(stride) == 1
    huge = pkl.replace(stride, b"\x8a\x09" + (1 << 64).to_bytes(9, "little") + b"\x85q\t")
    refused(with_pickle(data, huge, tmp_path / "s.pt"), "past 2**63")
    hooks = b")Rq\x0bt"  # the hooks' OrderedDict(), then the end of the tensor's arguments
    assert pkl.count(hooks) == 1
    meta = pkl.replace(hooks, b")Rq\x0bJ\xff\xff\xff\xfft")
    refused(with_pickle(data, meta, tmp_path / "m.pt"), "metadata that is not a dict")


def test_zips_torch_refuses_are_refused(tmp_path):
    """No version record; an end record whose counts disagree (miniz: 'multidisk')."""
    recs = {n: d for n, d in records(saved({"w": torch.ones(2)})).items()
            if not n.endswith("/version")}
    path = tmp_path / "v.pt"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in recs.items():
            z.writestr(n, d)
    refused(path, "no version record")
    data = bytearray(saved({"w": torch.ones(2)}))
    end64 = bytes(data).rindex(b"PK\x06\x06")  # torch writes the zip64 end record always
    struct.pack_into("<Q", data, end64 + 32, 134)  # total entries, not this disk's
    path.write_bytes(bytes(data))
    refused(path, "miscounts")


@pytest.mark.parametrize("field,value,words", [
    (30, 2048, "runs past the directory's end"),  # the last header's extra field, 2 KB long
    (34, 3, "names another disk"),                # the first header's disk number
    (38, 16, "marked as a directory"),            # the first header's DOS attributes
    (8, 0x2800, "flags 0x2800"),                  # the first header: a masked local dir
    (6, 84, "zip file version"),                  # "version needed" 8.4: zipfile raised
])
def test_central_directory_headers_miniz_refuses_are_refused(tmp_path, field, value, words):
    """zipfile reads a last central directory header whose extra field runs past the
    directory (it reads what there is) and a header naming disk 3; miniz refuses both
    ('invalid header', 'multidisk'), and miniz reads a record marked as a directory as other
    bytes: found by the differential fuzzer, seeds 1 and 2."""
    data = bytearray(saved({"w": torch.ones(2)}))
    heads = [i for i in range(len(data)) if data[i:i + 4] == b"PK\x01\x02"]
    struct.pack_into("<H", data, (heads[-1] if field == 30 else heads[0]) + field, value)
    # (the first record is data.pkl: marked as a directory, torch reads no pickle)
    path = tmp_path / "cd.pt"
    path.write_bytes(bytes(data))
    if field != 6:  # (miniz ignores the version; zipfile raised NotImplementedError)
        with pytest.raises((RuntimeError, pickle.UnpicklingError)):
            torch.load(path, weights_only=True)
    refused(path, words)


def test_a_tensor_rebuilt_from_fewer_arguments_than_torch_needs_is_refused(tmp_path):
    """_rebuild_tensor_v2(storage, offset, size, stride) without requires_grad and
    backward_hooks: torch's TypeError, mpitailor read it (seed 3, input 272565)."""
    t = torch.ones(2)
    pkl = pickle_of(saved({"w": t}))
    # NEWFALSE (requires_grad) dropped: five arguments, the hooks taken for requires_grad
    cut = pkl.replace(b"\x89ccollections\nOrderedDict\nq", b"ccollections\nOrderedDict\nq", 1)
    assert cut != pkl
    path = with_pickle(saved({"w": t}), cut, tmp_path / "x.pt")
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)
    refused(path, "missing 1 required positional argument")


@pytest.mark.parametrize("record,value,words", [
    ("byteorder", b"dittle", "little-endian machines only"),
    ("byteorder", b"big", "little-endian machines only"),  # torch byteswaps; not read here
    (".storage_alignment", b"6\xb4", "not a number"),
    ("version", b"ZZ", "not a torch file format version"),  # seed 3, input 954276
    ("version", b"11", "not a torch file format version"),  # torch 2.13 reads 1 to 10
])
def test_the_records_torch_reads_before_the_pickle_are_checked(tmp_path, record, value, words):
    """torch refuses a byteorder other than little or big and int()s .storage_alignment
    before it unpickles: found by the differential fuzzer, seed 3."""
    recs = records(saved({"w": torch.ones(2)}))
    name = next(n for n in recs if n.endswith("/" + record))
    path = rezip({**recs, name: value}, tmp_path / "x.pt")
    if value != b"big":
        with pytest.raises((ValueError, RuntimeError)):
            torch.load(path, weights_only=True)
    refused(path, words)


def test_a_storage_location_that_is_not_a_string_is_refused(tmp_path):
    """The location field of a storage's persistent id (torch decodes bytes there as ASCII
    and fails on others: seed 3, input 635876): only a string, as torch writes it."""
    data = saved({"w": torch.ones(2)})
    pkl = pickle_of(data)
    assert pkl.count(uni("cpu")) == 1
    path = with_pickle(data, pkl.replace(uni("cpu"), b"K\x07"), tmp_path / "x.pt")
    refused(path, "a persistent id torch does not write")


# ---- helper attack of 2026-11-28: keys hashed past _small_key, views torch reads otherwise --

def _shared_tuple(depth: int) -> bytes:
    """Opcodes of t_{i+1} = (t_i, t_i) from t_0 = (): 4 bytes a level (t_i on the stack, its
    copy from the memo), 2**depth leaves."""
    return b")q\x00" + b"h\x00\x86q\x00" * depth


def _nested_tuple(depth: int) -> bytes:
    """Opcodes of ((((...)))): one TUPLE1 a level."""
    return b")" + b"\x85" * depth


def _torch_file(pkl: bytes, path: Path, storage: bytes | None = None) -> Path:
    recs = {"archive/data.pkl": pkl, "archive/byteorder": b"little"}
    if storage is not None:
        recs["archive/data/0"] = storage
    return rezip(recs, path)


@pytest.mark.parametrize("call", [
    b"ccollections\nOrderedDict\n]" + _nested_tuple(200_000) + b"K\x01\x86a\x85R.",
    b"ccollections\nCounter\n]" + _nested_tuple(200_000) + b"a\x85R.",
    b"ccollections\nOrderedDict\n]" + _shared_tuple(40) + b"K\x01\x86a\x85R.",
    b"ccollections\nCounter\n]" + _shared_tuple(40) + b"a\x85R.",
])
def test_ordered_dict_and_counter_called_with_keys_are_refused(tmp_path, call):
    """Attack 04/05: OrderedDict([(K, 1)]) or Counter([K]) by REDUCE hashed K unchecked: K
    nested 200,000 deep segfaulted the process (C's stack), K a memo-shared tuple 40 levels
    deep would hash for hours. torch's pickles call OrderedDict() and Counter(a dict) and add
    the items after, which SETITEM checks."""
    refused(_torch_file(b"\x80\x02" + call, tmp_path / "x.pt"), "called with arguments")


def test_a_persistent_id_naming_a_deep_object_is_refused_not_hashed(tmp_path):
    """Attack 05 (pid variant): `pid[1] in DTYPE_OF` hashed whatever the pickle put there."""
    pid = (b"(X\x07\x00\x00\x00storage" + _nested_tuple(200_000)
           + b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ.")
    refused(_torch_file(b"\x80\x02" + pid, tmp_path / "x.pt", bytes(16)), "persistent id")


def test_stand_ins_compared_by_their_states_are_walked_first(tmp_path):
    """Attack 04 (eq variant): two numpy.dtype stand-ins of one hash as dict keys, their BUILD
    states dicts holding a tuple shared 2**40 times: the dict compared the states in C."""
    def key(slot: int) -> bytes:
        s = slot.to_bytes(4, "little")
        shared = b")" + (b"r" + s + b"j" + s + b"\x86") * 40
        return (b"cnumpy\ndtype\nX\x02\x00\x00\x00f4\x89\x88\x87R"
                + b"}X\x01\x00\x00\x00s" + shared + b"sb")
    pkl = b"\x80\x02}" + key(100_000) + b"K\x01s" + key(200_000) + b"K\x02s."
    refused(_torch_file(pkl, tmp_path / "x.pt"), "objects", allow=("numpy",), opaque_ok=True)


def test_a_shape_of_thousands_of_huge_dims_is_refused_at_once(tmp_path):
    """Attack 10: a shape of 2**62 x 40,000 then 0 (2 bytes a dim, memo): its element count
    took 18 s of big-int products and was then accepted (0 elements); torch refuses it."""
    big = b"\x8a\x08" + (2 ** 62).to_bytes(8, "little")
    pkl = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" 
           b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
           b"X\x03\x00\x00\x00cpuK\x04tQK\x00(" + big + b"q\x01" + b"h\x01" * 39_999
           + b"K\x00tq\x02h\x02\x89ccollections\nOrderedDict\n)RtR.")
    refused(_torch_file(pkl, tmp_path / "x.pt", bytes(16)), "past 2**63")


@pytest.mark.parametrize("view", ["neg", "conj"])
def test_a_negated_or_conjugated_view_is_refused(tmp_path, view):
    """Attack 12: torch.save of a neg view (a real file, no byte patched) stores the bytes
    before negation and {'neg': True}: torch.load negates, a byte copy did not (recover wrote
    the master weights negated, a reshard's Adam step became -10). conj likewise."""
    data = saved({"w": torch.arange(4.0)._neg_view()})
    path = tmp_path / f"{view}.pt"
    if view == "neg":
        path.write_bytes(data)
    else:  # on a float storage, as a crafted file would: torch refuses it, mpitailor too
        pkl = pickle_of(data).replace(b"X\x03\x00\x00\x00neg", b"X\x04\x00\x00\x00conj")
        with_pickle(data, pkl, path)
    refused(path, "negated or conjugated")


def test_copied_keeps_counters_and_an_ordered_dicts_attributes():
    """Attack 01: rawio.copied rebuilt dicts as type(obj)(pairs), so an optimizer state's
    Counter({'x': 7}) came out of recover as Counter({('x', 7): 1}), exit 0; and an
    OrderedDict lost its _metadata."""
    from mpitailor.formats.torch.rawio import copied
    od = OrderedDict(a=1)
    od._metadata = {"": {"version": 2}}
    got = copied({"c": Counter({"x": 7}), "od": od}, fd=-1)
    assert got["c"] == {"x": 7} and type(got["c"]).__name__ == "Counter"
    assert got["od"] == od and got["od"]._metadata == {"": {"version": 2}}
    assert got["od"] is not od


def test_verify_checks_the_record_that_holds_a_view_at_an_offset(tmp_path):
    """Attack 15: --verify looked up a tensor's first byte among the records' starts, so a
    genuine file whose tensor is a view at an offset of its storage was called damaged."""
    import os

    from mpitailor.formats.torch.verify import record_crcs, verify_records
    path = tmp_path / "v.pt"
    torch.save({"t": torch.arange(8.0)[2:]}, path)
    t = load(path)["t"]
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = record_crcs(path, fd)
        assert t.file_offset not in crcs  # inside its record, 8 bytes past its start
        verify_records(path, fd, {t.file_offset}, crcs)
        with pytest.raises(CheckpointError, match="no zip record holds"):
            verify_records(path, fd, {os.fstat(fd).st_size + 10}, crcs)
    finally:
        os.close(fd)
    raw = bytearray(path.read_bytes())
    raw[t.file_offset] ^= 1
    path.write_bytes(bytes(raw))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="fails its CRC-32"):
            verify_records(path, fd, {t.file_offset}, record_crcs(path, fd))
    finally:
        os.close(fd)


# ---- the second attack of 2026-11-28 ------------------------------------------------------

def _shifted(raw: bytes, prefix: bytes) -> bytes:
    """The zip `raw` (no zip64 records) after `prefix`, every offset moved with it: a file
    zipfile and miniz both read as that zip, which torch.load would read as a legacy pickle
    (it looks at the first bytes)."""
    end = raw.rindex(b"PK\x05\x06")
    cd_size, cd_at = struct.unpack_from("<II", raw, end + 12)
    cd, at = bytearray(raw[cd_at:cd_at + cd_size]), 0
    while at < len(cd):
        n, x, c = struct.unpack_from("<HHH", cd, at + 28)
        struct.pack_into("<I", cd, at + 42, struct.unpack_from("<I", cd, at + 42)[0] + len(prefix))
        at += 46 + n + x + c
    tail = bytearray(raw[end:])
    struct.pack_into("<I", tail, 16, cd_at + len(prefix))
    return prefix + raw[:cd_at] + bytes(cd) + bytes(tail)


def test_a_zip_that_does_not_begin_the_file_is_refused(tmp_path):
    """Attack 6.05 (CRITICAL): a pickle in front of a genuine scheduler.pt, every offset
    moved: zipfile and miniz read the zip, but torch.load looks at the first bytes, sees no
    zip and unpickles the legacy format from byte 0 (weights_only=False ran the payload);
    mpitailor carried the file as it was."""
    raw = rezip(records(saved({"w": torch.ones(2)})), tmp_path / "z.pt").read_bytes()
    path = tmp_path / "x.pt"
    path.write_bytes(_shifted(raw, pickle.dumps({"a": 1}, protocol=2)))
    assert zipfile.ZipFile(path).namelist()  # zipfile reads it
    refused(path, "does not begin with a zip record")


def test_a_zip64_end_record_not_where_its_locator_says_is_refused(tmp_path):
    """Attack 6.01 (CRITICAL): zipfile takes the zip64 end record just before the locator,
    miniz the one at the locator's offset: two central directories, one for each reader."""
    path = tmp_path / "x.pt"
    zip_write.write_torch_file(path, {"w": Tensor.of_bytes(bytes(8), "fp32", (2,))})
    raw = bytearray(path.read_bytes())
    loc = raw.rindex(b"PK\x06\x07")
    struct.pack_into("<Q", raw, loc + 8, struct.unpack_from("<Q", raw, loc + 8)[0] - 8)
    path.write_bytes(bytes(raw))
    refused(path, "zip64 end record")


def test_a_torchscript_archive_is_refused(tmp_path):
    """Attack 6.07: a `constants.pkl` record makes torch.load hand the file to torch.jit.load
    (weights_only=True refuses it); mpitailor read data.pkl and carried the file."""
    recs = records(saved({"w": torch.ones(2)}))
    refused(rezip({**recs, "archive/constants.pkl": pickle.dumps(())}, tmp_path / "x.pt"),
            "TorchScript")


def test_rebuild_from_type_hashes_no_type_it_was_not_given(tmp_path):
    """Attack 6.04: `new_type not in _TENSOR_TYPES` hashed a tuple nested 200,000 deep
    (a segfault) or shared 2**40 times (hours) before checking it was a type."""
    for new_type in (_nested_tuple(200_000), _shared_tuple(40)):
        pkl = (b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(ctorch._utils\n"
               b"_rebuild_tensor_v2\n" + new_type + b")NtR.")
        refused(_torch_file(pkl, tmp_path / "x.pt"), "_rebuild_from_type_v2")


def test_a_marker_record_in_upper_case_alone_is_refused(tmp_path):
    """Attack 6.08: `BYTEORDER` = big and no `byteorder`: torch found it ignoring case and
    swapped every storage's bytes, mpitailor saw no byteorder record and read them as they
    are (recover --verify exit 0, diff 'identical')."""
    recs = {("archive/BYTEORDER" if n == "archive/byteorder" else n): (b"big" if n.endswith(
        "byteorder") else d) for n, d in records(saved({"w": torch.ones(2)})).items()}
    refused(rezip(recs, tmp_path / "x.pt"), "upper case")


def test_stand_ins_of_one_hash_with_other_states_are_bounded_as_keys(tmp_path):
    """Attack 6.09: N numpy.dtype stand-ins with BUILD states of their own as dict keys all
    hashed alike (stand-ins hash by name and arguments) and the dict compared them N**2/2
    times (34 s for 225 KB): at most 64 keys of one hash are taken."""
    key = lambda i: b"cnumpy\ndtype\nX\x02\x00\x00\x00f4\x89\x88\x87RJ" + struct.pack("<i", i) + b"b"
    pkl = b"\x80\x02}(" + b"".join(key(i) + b"K\x01" for i in range(100)) + b"u."
    refused(_torch_file(pkl, tmp_path / "x.pt"), "of one hash", allow=("numpy",),
            opaque_ok=True)


def test_numpy_scalars_as_dict_keys_and_set_members_are_read(tmp_path):
    """Third attack 7.01: refusing every stand-in with a state as a key (b3515e3) refused
    genuine client states keyed by numpy scalars (their dtype pickles with a state)."""
    path = tmp_path / "x.pt"
    torch.save({"a": {np.int64(0): 1.5, np.float32(0.5): 2}, "b": set(np.unique([3, 1, 3])),
                "c": {np.str_("k"): 1}}, path)
    got = load(path, allow=("numpy",), opaque_ok=True)
    assert len(got["a"]) == 2 and len(got["b"]) == 2 and len(got["c"]) == 1


def test_a_zip64_locator_of_several_disks_is_refused(tmp_path):
    """Third attack 7.03: the locator's disk count set to 0: zipfile reads the file, miniz
    refuses it ('unsupported multidisk archive')."""
    path = tmp_path / "x.pt"
    zip_write.write_torch_file(path, {"w": Tensor.of_bytes(bytes(8), "fp32", (2,))})
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, raw.rindex(b"PK\x06\x07") + 16, 0)
    path.write_bytes(bytes(raw))
    refused(path, "several disks")


@pytest.mark.parametrize("member", ["dict", "set"])
def test_keys_crafted_to_share_one_hash_are_refused(tmp_path, member):
    """Attack 6.10: ints hash modulo 2**61 - 1, so 40,000 keys k * (2**61 - 1) (7 bytes each)
    all shared one hash and a dict compared each new key with all the others (15 s for 284
    KB; torch's own loader pays the same). Counted as added: refused past 64 of one hash."""
    def long1(v: int) -> bytes:
        n = v.bit_length() // 8 + 1
        return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)
    keys = [long1(k * (2 ** 61 - 1)) for k in range(1, 200)]
    if member == "dict":
        pkl = b"\x80\x02}(" + b"".join(k + b"N" for k in keys) + b"u."
    else:
        pkl = b"\x80\x02cbuiltins\nset\n](" + b"".join(keys) + b"e\x85R."
    refused(_torch_file(pkl, tmp_path / "x.pt"), "of one hash")


def test_a_tensor_of_a_dtype_mpitailor_does_not_read_says_so(tmp_path):
    """Third attack 7.02: a genuine complex64 tensor was refused with 'if you trust this file,
    --safe-globals torch.ComplexFloatStorage allows it', and the flag then gave 'unreadable
    or truncated'. No flag makes mpitailor read such a dtype: the line says what it reads."""
    path = tmp_path / "c.pt"
    torch.save({"c": torch.zeros(2, dtype=torch.complex64)}, path)
    msg = refused(path, "a dtype mpitailor does not read", "ComplexFloatStorage")
    assert "--safe-globals" not in msg
