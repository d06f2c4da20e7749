"""A PyTorch Distributed Checkpoint's `.metadata`, read without torch into frozen values.

DCP (`torch.distributed.checkpoint`: FSDP2, torchtitan, Accelerate FSDP, Megatron's
`torch_dist`) writes one `.metadata` beside its data files (`__<rank>_<n>.distcp`): for
every entry of the flattened state dict, a tensor's dtype, global size and chunks (each
rank's piece: offsets and sizes), or a bytes entry (anything else, torch.save'd); and for
every chunk and bytes entry, the file, byte offset and length of its serialised item.
metadata_pickle.py reads the pickle through an allow-list; this checks what it describes
(every chunk inside its tensor, the chunks of a tensor tiling it without overlap, every
chunk and bytes entry stored exactly once, in a plain file of the checkpoint dir) and makes
the values the rest of the family reads. Anything else is one CheckpointError line naming
the file.
"""
from __future__ import annotations

import itertools
import math
import os
import pickle
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp.metadata_pickle import DType, Rec, Refused, unpickle
from mpitailor.formats.dtypes import DTYPES, canonical
from mpitailor.formats.io import read_small, shown

METADATA = ".metadata"
DATA_SUFFIX = ".distcp"
MAX_METADATA_BYTES = 1 << 30  # a 405B model's is ~100 MB
_PREFIX = "torch.distributed.checkpoint."


# The records below travel between ranks (the plan is broadcast): each pickles as a call of
# its class with its fields, one call each way, where a slots dataclass's own state methods
# (3.11) look its fields up on every instance, both ways (0.15 s a broadcast, at 2,646 items).


@dataclass(frozen=True, slots=True)
class Chunk:
    """One rank's piece of a tensor: where it starts in each dimension, and its sizes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def __reduce__(self):
        return Chunk, (self.offsets, self.sizes)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the state dict: its dtype (mpitailor's name: formats/dtypes.py), global
    size and chunks (as saved)."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * DTYPES[self.dtype].itemsize

    def __reduce__(self):
        return TensorEntry, (self.dtype, self.size, self.chunks)


@dataclass(frozen=True, slots=True)
class Item:
    """Where one chunk (or bytes entry) is stored: a data file of the checkpoint dir, and the
    byte range its serialised form takes there (a torch.save zip, or raw bytes).

    A chunk written by `FileSystemWriter(serialization_format=SAFETENSORS)` is no item of
    its own: the writer puts every chunk of a data file into one safetensors blob at the
    file's end, and records each chunk at the blob's start with the chunk's byte count as
    its length (`safetensors` True; items.py finds the chunk by its name in the blob's
    header). A torch.save zip is never as short as its tensor's bytes, so the metadata
    alone tells the two apart."""

    fqn: str
    offsets: tuple[int, ...] | None  # the chunk's offsets; None: a bytes entry
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...]  # stream transforms applied when written (compression)
    safetensors: bool = False  # a chunk of its file's safetensors blob (above)

    def __reduce__(self):
        return Item, (self.fqn, self.offsets, self.file, self.offset, self.length,
                      self.transforms, self.safetensors)


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    tensors: Mapping[str, TensorEntry]
    bytes_entries: tuple[str, ...]
    items: Mapping[tuple[str, tuple[int, ...] | None], Item]  # (fqn, chunk offsets) -> item
    version: str | None
    save_id: str | None
    # the save planner's map of each flattened key to its path in the nested state dict
    # (DefaultSavePlanner's), carried into what mpitailor writes; {} where there is none
    planner_data: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)
    # the ranks that saved, where the metadata says (Megatron's `all_local_plans`: one
    # SavePlan per rank, also those that wrote no data file); None where it does not
    ranks: int | None = None

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted({i.file for i in self.items.values()}))

    def __reduce__(self):
        return DcpMetadata, (self.tensors, self.bytes_entries, self.items, self.version,
                             self.save_id, self.planner_data, self.ranks)


# What torch's HuggingFaceStorageWriter(save_distributed=True) names each rank's file
# (_hf_utils.SHARDED_FILE_NAME): DCP chunks in HF-style safetensors files, no `.metadata`.
HF_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")


def is_dcp_dir(path: Path) -> bool:
    """Does path hold a `.metadata` (whatever it is: a link or a FIFO there is then refused
    by name when it is read, not taken for another kind of checkpoint), or the per-rank
    files of torch's HuggingFaceStorageWriter (refused by name when read)?"""
    return os.path.lexists(path / METADATA) or _hf_shards(path) is not None


def _hf_shards(path: Path) -> str | None:
    """The first per-rank file of HuggingFaceStorageWriter in path, if any."""
    try:
        with os.scandir(path) as it:
            return next((e.name for e in it if HF_SHARD.fullmatch(e.name)), None)
    except OSError:
        return None


def read_metadata(folder: Path) -> DcpMetadata:
    """The checked metadata of the DCP checkpoint in folder; CheckpointError (one line,
    naming the file) if it cannot be read or describes what DCP does not write."""
    path = folder / METADATA
    shard = None if os.path.lexists(path) else _hf_shards(folder)
    if shard is not None:
        raise CheckpointError(
            f"{shown(folder / shard)}: a rank's file of torch's HuggingFaceStorageWriter "
            f"(save_distributed, no .metadata), which mpitailor does not read: no file says "
            f"a tensor's size or that every rank's file is there, and the writer keeps no "
            f"non-tensor entry; save with FileSystemWriter, or consolidate "
            f"(enable_consolidation=True writes HF weights)")
    data = read_small(path, MAX_METADATA_BYTES, "a DCP .metadata file")
    try:
        raw = unpickle(data)
        _used.clear()
        try:
            return _checked(raw)
        finally:
            _used.clear()
    except Refused as e:
        raise CheckpointError(f"{shown(path)}: names {e.name}, which is not one of DCP's "
                              f"metadata classes; not read (a file made to run code when "
                              f"torch loads it?)") from None
    except _Bad as e:
        raise CheckpointError(f"{shown(path)}: {e}; not a DCP checkpoint mpitailor can "
                              f"read") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, OverflowError, UnicodeDecodeError, MemoryError,
            RecursionError, struct.error) as e:
        first = str(e).strip().split("\n")[0] or type(e).__name__
        raise CheckpointError(f"{shown(path)}: unreadable DCP metadata ({first[:200]}); "
                              f"re-copy it from the original save") from None


class _Bad(Exception):
    """What the metadata describes is not what DCP writes."""


_used: set[int] = set()  # ids of the records (and chunk lists) the read in progress took


def _rec(x, kind: str) -> dict | tuple:
    """The state of record x of DCP class `kind` (e.g. "metadata.Metadata"), taken once:
    DCP writes every record once, and a record the pickle shares among many entries (its
    memo makes that free) would make this check, and every later reader, do the work of
    all of them."""
    if type(x) is not Rec or x.kind != _PREFIX + kind:
        raise _Bad(f"a {type(x).__name__ if type(x) is not Rec else x.kind} where DCP writes "
                   f"a {kind.rsplit('.', 1)[-1]}")
    _take(x)
    return x.state


def _take(x) -> None:
    if id(x) in _used:
        raise _Bad("a record shared among several entries (DCP writes each once)")
    _used.add(id(x))


def _fields(x, kind: str, names: tuple[str, ...]) -> dict:
    state = _rec(x, kind)
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise _Bad(f"a {kind.rsplit('.', 1)[-1]} whose state is not its fields")
    return {n: state.get(n) for n in names}


def _checked(raw) -> DcpMetadata:
    top = _fields(raw, "metadata.Metadata",
                  ("state_dict_metadata", "storage_data", "storage_meta", "version",
                   "planner_data", "all_local_plans"))
    entries, storage = top["state_dict_metadata"], top["storage_data"]
    if type(entries) is not dict or type(storage) is not dict:
        raise _Bad("state_dict_metadata and storage_data are not mappings")
    tensors, blobs = {}, []
    for fqn, entry in entries.items():
        if type(entry) is Rec and entry.kind == _PREFIX + "metadata.BytesStorageMetadata":
            blobs.append(fqn)
        else:
            tensors[fqn] = _tensor(fqn, entry)
    items = _items(storage, tensors, set(blobs))
    version = top["version"]
    save_id = None
    if top["storage_meta"] is not None:
        save_id = _fields(top["storage_meta"], "metadata.StorageMeta", ("save_id",))["save_id"]
    if not (version is None or type(version) is str) or not (save_id is None
                                                             or type(save_id) is str):
        raise _Bad("version or save_id is not a string")
    return DcpMetadata(tensors, tuple(blobs), items, version, save_id,
                       _planner_data(top["planner_data"], set(tensors) | set(blobs)),
                       _ranks(top["all_local_plans"]))


def _ranks(plans) -> int | None:
    """How many SavePlans Megatron's `all_local_plans` lists (one per rank); their contents
    are not read (what was stored is storage_data's word)."""
    if plans is None:
        return None
    if type(plans) is not list or not plans or not all(
            type(p) is Rec and p.kind == _PREFIX + "planner.SavePlan" for p in plans):
        raise _Bad("all_local_plans is not a list of SavePlans")
    return len(plans)


def _planner_data(raw, keys: set[str]) -> dict:
    """DefaultSavePlanner's {flattened key: path of str and int} for the state dict's own
    keys, each path joining to its key (DCP flattens so); {} for None or a mapping of other
    keys a custom planner put there (not carried). A mapping of the state dict's keys to
    something else is damage (a flipped byte re-pointing a pickle memo gives one): torch's
    own reader then looks for entries nobody saved."""
    if type(raw) is not dict or not all(type(k) is str and k in keys for k in raw):
        return {}
    for k, v in raw.items():
        if type(v) is not tuple or not v or not all(type(p) in (str, int) for p in v) \
                or ".".join(map(str, v)) != k:
            raise _Bad(f"planner data maps {k!r:.80} to {v!r:.80}, which is not its path in "
                       f"the state dict")
    return dict(raw)


MAX_DIMS = 64
MAX_ELEMENTS = 1 << 62


def _dims(x, what: str) -> tuple[int, ...]:
    """A size or offsets: a tuple of at most MAX_DIMS ints in [0, MAX_ELEMENTS) whose
    product is below MAX_ELEMENTS (a size), as torch.Size holds them."""
    if type(x) is not tuple or len(x) > MAX_DIMS or not all(
            type(d) is int and 0 <= d < MAX_ELEMENTS for d in x):
        raise _Bad(f"{what} is not a size (a tuple of at most {MAX_DIMS} non-negative ints)")
    n = 1
    for d in x:
        n *= d
        if n >= MAX_ELEMENTS:
            raise _Bad(f"{what} of {MAX_ELEMENTS} elements or more")
    return x


def _tensor(fqn: str, entry) -> TensorEntry:
    f = _fields(entry, "metadata.TensorStorageMetadata", ("properties", "size", "chunks"))
    dtype = _dtype(f["properties"])
    size = _dims(f["size"], f"tensor {fqn!r:.80}: its size")
    if type(f["chunks"]) is not list or not f["chunks"]:
        raise _Bad(f"tensor {fqn!r:.80}: no chunks")
    _take(f["chunks"])
    chunks = []
    for c in f["chunks"]:
        cf = _fields(c, "metadata.ChunkStorageMetadata", ("offsets", "sizes"))
        offsets = _dims(cf["offsets"], f"tensor {fqn!r:.80}: a chunk's offsets")
        sizes = _dims(cf["sizes"], f"tensor {fqn!r:.80}: a chunk's sizes")
        if not len(offsets) == len(sizes) == len(size) or any(
                o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise _Bad(f"tensor {fqn!r:.80}: a chunk outside its size {size}")
        chunks.append(Chunk(offsets, sizes))
    _check_tiling(fqn, size, chunks)
    return TensorEntry(dtype, size, tuple(chunks))


def _dtype(props) -> str:
    state = _rec(props, "metadata.TensorProperties")
    dtype = state[0] if type(state) is tuple and len(state) == 5 else \
        state.get("dtype") if type(state) is dict else None
    name = canonical(str(dtype)) if type(dtype) is DType else None
    if name is None:
        raise _Bad(f"a tensor of dtype {str(dtype)[:20]!r}, which mpitailor does not read")
    return name


MAX_CELLS = 1 << 22  # cells of the grid the chunks' boundaries cut a tensor into


def _check_tiling(fqn: str, size: tuple[int, ...], chunks: list[Chunk]) -> None:
    """The chunks cover the tensor, each element once (DCP saves a tensor whole, every
    element by one rank: a dedup'd replica leaves one chunk). The chunks' boundaries cut
    each dimension into intervals, the tensor into a grid of cells: each chunk must cover
    whole cells, no cell twice; with the chunks' volumes summing to the tensor's, every
    cell is then covered. FSDP x TP's grids (64 x 8) cost a cell each."""
    total = sum(c.numel for c in chunks)
    if total != math.prod(size):
        raise _Bad(f"tensor {fqn!r:.80}: its chunks hold {total} elements, the tensor "
                   f"{math.prod(size)}")
    live = [c for c in chunks if c.numel]
    if len(live) < 2:
        return
    cuts = [sorted({0, d} | {c.offsets[k] for c in live} | {c.offsets[k] + c.sizes[k]
                                                           for c in live})
            for k, d in enumerate(size)]
    if math.prod(len(b) - 1 for b in cuts) > MAX_CELLS:
        raise _Bad(f"tensor {fqn!r:.80}: chunks cutting it into over {MAX_CELLS} cells")
    index = [{b: i for i, b in enumerate(bs)} for bs in cuts]
    covered: set[tuple[int, ...]] = set()
    for c in live:
        spans = [range(index[k][o], index[k][o + n]) for k, (o, n) in
                 enumerate(zip(c.offsets, c.sizes))]
        for cell in itertools.product(*spans):
            if cell in covered:
                raise _Bad(f"tensor {fqn!r:.80}: two chunks overlap")
            covered.add(cell)


def _items(storage: dict, tensors: dict[str, TensorEntry], blobs: set[str]) -> dict:
    items = {}
    for index, info in storage.items():
        key = _fields(index, "metadata.MetadataIndex", ("fqn", "offset"))
        fqn, offsets = key["fqn"], key["offset"]
        s = _fields(info, "filesystem._StorageInfo",
                    ("relative_path", "offset", "length", "transform_descriptors"))
        name, transforms = s["relative_path"], s["transform_descriptors"] or []
        if type(fqn) is not str:
            raise _Bad("a storage index without a name")
        if offsets is not None:
            offsets = _dims(offsets, f"entry {fqn!r:.80}: a storage index's offsets")
        if not _plain_name(name) or not all(type(v) is int and 0 <= v < 1 << 62
                                            for v in (s["offset"], s["length"])):
            raise _Bad(f"entry {fqn!r:.80}: stored at {str(name)[:80]!r}, not a file of the "
                       f"checkpoint dir, or at a range that is not one")
        if type(transforms) is not list or not all(type(t) is str for t in transforms):
            raise _Bad(f"entry {fqn!r:.80}: transform descriptors that are not names")
        if (fqn, offsets) in items:
            raise _Bad(f"entry {fqn!r:.80}: stored twice")
        items[fqn, offsets] = Item(fqn, offsets, name, s["offset"], s["length"],
                                   tuple(transforms))
    for fqn, t in tensors.items():
        for c in t.chunks:
            if (fqn, c.offsets) not in items:
                raise _Bad(f"tensor {fqn!r:.80}: chunk at {c.offsets} is stored nowhere")
            item = items[fqn, c.offsets]
            if item.length == c.numel * DTYPES[t.dtype].itemsize and not item.transforms:
                items[fqn, c.offsets] = replace(item, safetensors=True)
    for fqn in blobs:
        if (fqn, None) not in items and (fqn, ()) not in items:
            raise _Bad(f"entry {fqn!r:.80} is stored nowhere")
    known = {(f, c.offsets) for f, t in tensors.items() for c in t.chunks}
    extra = [k for k in items if k not in known and k[0] not in blobs]
    if extra:
        raise _Bad(f"storage for {extra[0][0]!r:.80}, which the state dict does not hold")
    return items


def _plain_name(name) -> bool:
    return type(name) is str and 0 < len(name) <= 255 and "/" not in name and \
        "\\" not in name and "\0" not in name and name not in (".", "..") and \
        name != METADATA
