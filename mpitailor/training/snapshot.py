"""A partial save in two halves: what it holds, taken from the live engine (`take`), and the
files written, fsynced and published from that (`write`).

A synchronous save runs both at once and writes the chosen slices straight from the
engine's buffers. An asynchronous one (checkpointer.py) copies the slices into host buffers
that are allocated once and reused (`HostBuffers`) and has a background writer run `write`
while training goes on; overlapped (overlap.py), the copy itself is the writer's first
step (`Snapshot.copy`), while the next training step's forward and backward run, and the
optimizer's step waits for it. The small states (DeepSpeed's model states, the optimizer's
non-tensor state, rng) are serialised while the engine is still still: the file's bytes
are the snapshot.
"""
from __future__ import annotations

import io
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch

from mpitailor import failpoints
from mpitailor.errors import MpitailorError, UserError
from mpitailor.facade import Comm, parse_size, publishing
from mpitailor.formats.dtypes import name_of
from mpitailor.formats.hf import write_safetensors
from mpitailor.formats.io import write_synced
from mpitailor.formats.manifest import PARTIAL_FORMAT, Manifest, PartialFields
from mpitailor.formats.zero import partial_files


class PartialSaveFailed(RuntimeError):
    """Some rank could not write its part; nothing was published."""


@dataclass
class Snapshot:
    """One rank's part of a partial save, ready to be written."""

    final: Path                      # the tag dir it publishes
    rank: int                        # this rank's number in the training world
    leader: bool                     # this rank stages and publishes (save_leader)
    blobs: dict[str, bytes]          # file name -> its bytes (torch files, serialised)
    slices: dict[str, torch.Tensor]  # `{kind}/{name}` -> this rank's slice of a chosen layer
    fields: PartialFields            # the manifest's fields (rank 0's count)
    on_published: Callable[[], None] | None = None  # leader, after the rename (HF `latest`)
    seconds: dict = field(default_factory=dict)     # taking it: "gather" (states, slices),
    # "copy" (into host buffers), "serialise" (the small states); "background", "waited"
    # Overlapped: the copy into host buffers still to make, the writer's first step (slices
    # are the engine's live ones until it ran); it releases the step it holds, done or not.
    copy: Callable[[], dict[str, torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slices.values())


def as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("internal error: a partial save writes contiguous CPU tensors")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def torch_bytes(obj) -> bytes:
    """What torch.save writes to a file, as bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


MIN_HOST_BYTES = 1 << 20  # below 1 MiB: a unit slip (1000 meant as MB?), not a budget


def host_bytes_limit(value) -> int | None:
    """max_host_bytes as given (None, a count of bytes, or a size string read as
    --max-shard-size reads it: "2GB", "512MiB") -> bytes; UserError for anything else, or
    for less than MIN_HOST_BYTES."""
    if value is None:
        return None
    size = value
    if isinstance(value, str):
        try:
            size = parse_size(value)
        except ValueError:
            size = None
    if isinstance(size, bool) or not isinstance(size, int):
        raise UserError(f"max_host_bytes={value!r}: give a number of bytes or a size such as "
                        f"'2GB', '512MiB' (or None: no limit)")
    if size < MIN_HOST_BYTES:
        raise UserError(f"max_host_bytes={value!r}: {size} bytes is below the least accepted, "
                        f"1 MiB ({MIN_HOST_BYTES}); give bytes (2 * 2**30) or a size such as "
                        f"'2GB', '512MiB'")
    return size


class HostBuffers:
    """One host buffer per dtype for an asynchronous save's slices, reused by every save;
    never above `limit` bytes, when set. `reserve` allocates and touches it (the checkpointer
    does, at its first partial save, for the largest save its policy can make: a fresh page
    costs a fault on first touch, so a save that grew the buffer would stall on them); a save
    that needs more still grows it."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def reserve(self, elements: int, dtype: torch.dtype = torch.float32) -> None:
        """Hold `elements` (at most what `limit` allows) of dtype, pages touched."""
        size = torch.empty(0, dtype=dtype).element_size()
        if self.limit is not None:
            elements = min(elements, self.limit // size)
        if dtype not in self._bufs or self._bufs[dtype].numel() < elements:
            self._bufs[dtype] = torch.zeros(elements, dtype=dtype, pin_memory=_pinnable())

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def need(self, slices: dict[str, torch.Tensor]) -> int:
        """Bytes the buffers will hold after copying `slices` (grown where needed)."""
        want = _elements(slices)
        return sum(max(n, self._bufs[d].numel() if d in self._bufs else 0)
                   * torch.empty(0, dtype=d).element_size() for d, n in want.items())

    def check(self, need: int) -> None:
        if self.limit is not None and need > self.limit:
            raise UserError(f"an asynchronous layer-wise save needs {need / 2**20:.2f} MiB "
                            f"({need} bytes) of host buffers on this rank, over max_host_bytes="
                            f"{self.limit / 2**20:.2f} MiB ({self.limit} bytes); raise the "
                            f"limit, save fewer layers at a time, or save synchronously")

    def copy(self, slices: dict[str, torch.Tensor], after=None) -> dict[str, torch.Tensor]:
        """The slices copied into the buffers (views of them, in the same order), in host
        memory on return. after: a CUDA event recorded on the training stream once the
        state was final (overlapped: the copies then run on a side stream of their own,
        after it, while training's kernels go on)."""
        want = _elements(slices)
        for dtype, n in want.items():
            if dtype not in self._bufs or self._bufs[dtype].numel() < n:
                self._bufs[dtype] = torch.empty(n, dtype=dtype, pin_memory=_pinnable())
        side = None
        if after is not None:
            # On the slices' GPU: this runs in the writer's thread, whose current device is
            # GPU 0 whatever the training thread set (a node's rank 3 trains on GPU 3).
            gpu = next(t.device for t in slices.values() if t.device.type == "cuda")
            side = torch.cuda.Stream(device=gpu)
            side.wait_event(after)
        with torch.cuda.stream(side) if side is not None else nullcontext():
            at: dict[torch.dtype, int] = {}
            out = {}
            for name, t in slices.items():
                i = at.get(t.dtype, 0)
                view = self._bufs[t.dtype][i: i + t.numel()]
                view.copy_(t.reshape(-1), non_blocking=True)
                out[name] = view.view(t.shape)
                at[t.dtype] = i + t.numel()
        if side is not None:
            side.synchronize()
        elif torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are in host memory before training goes on
        return out


def _elements(slices: dict[str, torch.Tensor]) -> dict[torch.dtype, int]:
    """Elements of the slices, per dtype (one host buffer each)."""
    want: dict[torch.dtype, int] = {}
    for t in slices.values():
        want[t.dtype] = want.get(t.dtype, 0) + t.numel()
    return want


def _pinnable() -> bool:
    return torch.cuda.is_available()


def write(snap: Snapshot, comm: Comm) -> Path:
    """Collective over comm (the training ranks, or the writer's own group): stage the save,
    every rank writes and fsyncs its files, the leaders write the manifest last and publish
    by rename. Any rank's failure is raised on every rank as PartialSaveFailed; then nothing
    is published and the staging dir is removed."""
    with publishing(snap.final, snap.leader) as staging:
        def begin() -> None:
            if snap.copy is not None:  # overlapped: the slices into host buffers first
                copy, snap.copy = snap.copy, None
                snap.slices = copy()
            if snap.leader:
                staging.acquire(None)
        agree(comm, begin)
        records = agree(comm, _write_rank, snap, staging.dir)
        files = {k: v for part in comm.allgather(records) for k, v in part.items()}
        manifest = Manifest("partial", files, snap.fields)

        def publish() -> None:
            _failpoint("partial-publish", snap.final)
            if snap.leader:
                staging.commit(manifest)
                if snap.on_published is not None:
                    snap.on_published()
        agree(comm, publish)
    return snap.final


def _write_rank(snap: Snapshot, root: Path) -> dict:
    _failpoint("partial-write", snap.final)
    records = {name: write_synced(root / name, data) for name, data in snap.blobs.items()}
    name = partial_files(snap.rank)["layers"]
    records[name] = write_safetensors(
        root / name, {k: (name_of(t.dtype), tuple(t.shape), as_bytes(t))
                      for k, t in snap.slices.items()}, metadata={"format": PARTIAL_FORMAT})
    return records


def _failpoint(point: str, final: Path) -> None:
    """A save is named by its tag, or by its dir and tag where every save has the same tag
    (Accelerate's `checkpoint-8/pytorch_model`)."""
    failpoints.hit(point, final.name)
    failpoints.hit(point, f"{final.parent.name}/{final.name}")


def agree(comm: Comm, fn, *args):
    """Collective: fn on every rank; any rank's failure raised on every rank."""
    try:
        return comm.step(fn, *args)
    except MpitailorError as e:
        raise PartialSaveFailed(f"partial checkpoint not saved: {e}") from None
