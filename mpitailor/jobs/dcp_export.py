"""`export DCP_DIR -o OUT --format hf --config MODEL` (issue 43): a PyTorch Distributed
Checkpoint's model weights as HF safetensors, on any number of MPI ranks.

What is written: the `model.` entries (`get_state_dict` + `dcp.save({"model": ...})`), named
without the prefix as `save_pretrained` names them, in their dtype (or --dtype), sharded as
`save_pretrained` cuts them (planning/hf_layout.py, as the ZeRO export), with
`model.safetensors.index.json` when sharded; and the config and tokenizer files of
`--config` (a DCP checkpoint carries none: refused without it), the config saying the dtype.

How: rank 0 reads the `.metadata` (formats/dcp, no torch), checks the data files hold what
it places in them, plans (planning/dcp_hf.py) and creates every weights file at its final
size with its header. Every rank then writes its share of the files' data: the files'
elements one after the other, cut into one contiguous range per rank, balanced by bytes (a
rank's range may cover the end of one file and the start of the next), each element read in
place from the chunk of the DCP tensor that holds it (engine/dcp_weights.py), cast on the
way for --dtype. Byte ranges rather than whole files per rank: an export is often one or a
few files (a 7B model in bf16 is three 5 GB shards), which whole files would leave to one
or three ranks; ranges keep every rank busy whatever the sharding, and the bytes do not
depend on the number of ranks. Rank 0 joins the ranges' CRC-32s, writes the index and the
manifest, and the output is published as every output is (publish/staging.py): whole or
not at all.

Collective: every rank calls run_dcp_export.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.engine.copyio import join_crcs
from mpitailor.engine.dcp_weights import write_share
from mpitailor.errors import UserError
from mpitailor.formats.dcp import (
    DcpMetadata,
    check_data_files,
    read_dcp_save_record,
    read_metadata,
)
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.hf import read_config, side_files, warn_if_another_model
from mpitailor.formats.io import (
    MAX_SIDE_FILE_BYTES,
    FileIdentity,
    close_all,
    crc32,
    create_sized,
    fsync_close,
    read_small,
    shown,
    write_synced,
)
from mpitailor.formats.manifest import ExportFields, Manifest
from mpitailor.jobs.dcp_recovery import holds_dcp_saves, recover_dcp_chain
from mpitailor.jobs.dcp_sources import read_dcp_sources, source_saves
from mpitailor.jobs.export import check_config
from mpitailor.jobs.merge import check_shard_size
from mpitailor.jobs.readable import refuse_inside_sources
from mpitailor.jobs.readlocks import hold_sources
from mpitailor.planning.dcp_hf import DcpHfPlan, plan_dcp_hf, shares
from mpitailor.planning.dcp_link import plan_links
from mpitailor.planning.dcp_plan import plan_dcp
from mpitailor.planning.hf_layout import DEFAULT_MAX_SHARD_SIZE, INDEX
from mpitailor.planning.recipe import Recipe
from mpitailor.publish.staging import commit_on_leaders, staged

NO_CONFIG = ("a DCP checkpoint carries no config.json, and from_pretrained needs one; pass "
             "--config with the model's config.json or model dir")


@dataclass(frozen=True, slots=True)
class DcpExportResult:
    output: Path
    bytes_written: int
    seconds: float
    files: int
    saves: tuple[str, ...] = ()   # of a save dir: the saves its newest composite takes from
    verified: object | None = None  # --verify: what was read back (jobs/dcp_verify.Verified)


def check_options(source: Path, fmt: str, config: Path | None) -> None:
    """Every rank: what a DCP export takes; UserError, one line, before any I/O."""
    if fmt != "hf":
        raise UserError(f"{shown(source)}: a DCP checkpoint exports as --format hf only "
                        f"(--format {fmt} reads DeepSpeed ZeRO checkpoints)")
    if config is None:
        raise UserError(f"{shown(source)}: {NO_CONFIG}")


def run_dcp_export(comm: Comm, source: Path, output: Path, fmt: str, dtype: str | None,
                   max_shard_size: int | None, config: Path | None = None,
                   verify: bool = False) -> DcpExportResult:
    """Collective: export the DCP checkpoint `source` as HF weights into `output`; verify:
    then read it back and check it (jobs/dcp_export_verify.py)."""
    t0 = time.perf_counter()
    check_options(source, fmt, config)
    check_shard_size(max_shard_size)
    comm.root_step(check_config, config)
    shard = DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    paths: dict[str, Path] = {}
    checked: dict[str, FileIdentity] = {}
    saves: tuple[str, ...] = ()
    if comm.root_step(holds_dcp_saves, source):  # a save dir: its newest composite
        recipe, _, checked = recover_dcp_chain(comm, source, output)
        meta, plan, paths, sources = comm.root_step(_plan_chain, recipe, checked, dtype, shard)
        saves = tuple(name for name, _ in recipe.sources)
    else:  # held as recover holds its sources: a prune meanwhile keeps an old composite
        comm.root_step(hold_sources, [source])
        comm.root_step(refuse_inside_sources, output, [(source.name, source)], "-o")
        meta, plan = comm.root_step(_plan, source, dtype, shard)
        sources = {"src": {"path": str(source), "save_id": meta.save_id, "format": "dcp"}}
    with staged(comm, output, [0]) as staging:
        side = comm.root_step(_lay_out, plan, config, staging.dir)
        share = shares(plan.weights, comm.size)[comm.rank]
        crcs = comm.step(write_share, source, meta, plan, staging.dir, share, paths, checked)
        failpoints.hit("export")
        gathered: dict[str, list] = {}
        for part in comm.allgather(crcs):
            for name, ranges in part.items():
                gathered.setdefault(name, []).extend(ranges)

        def manifest() -> Manifest:
            files = {**side, **_joined(plan, gathered)}
            if plan.weights.index is not None:
                files[INDEX] = write_synced(staging.dir / INDEX, plan.weights.index)
            return Manifest("export", files, ExportFields(
                format="hf", dtype=plan.weights.dtype, sources=sources,
                layers={}, mpi_ranks=comm.size))
        written = commit_on_leaders(comm, staging, [0], manifest)
    seconds = time.perf_counter() - t0
    verified = None
    if verify:
        from mpitailor.jobs.dcp_export_verify import verify_dcp_export
        verified = verify_dcp_export(comm, output, source, meta, plan, paths, checked)
    return DcpExportResult(output, written, seconds, len(plan.weights.files), saves, verified)


def _plan_chain(recipe: Recipe, checked: dict[str, FileIdentity], dtype: str | None,
                shard: int) -> tuple[DcpMetadata, DcpHfPlan, dict[str, Path], dict]:
    """Rank 0 only: the composite `recover` would write of a save dir's newest saves,
    planned in link mode (planning/dcp_link.py: every item where it lies in its source's
    data file) and exported from there, no composite written: its metadata, the export's
    plan, where each of its data files lies, and the manifest's sources."""
    merged = plan_dcp(recipe, read_dcp_sources(recipe, checked))
    linked = plan_links(merged)
    paths = {link.name: recipe.source_path(link.source) / link.file for link in linked.links}
    saves = source_saves(recipe)
    sources = {n: {"path": str(p), **saves[n], "format": "dcp"} for n, p in recipe.sources}
    return linked.output, plan_dcp_hf(linked.output, recipe.origin, dtype, shard), paths, \
        sources


def _plan(source: Path, dtype: str | None, shard: int) -> tuple[DcpMetadata, DcpHfPlan]:
    """Rank 0 only: the checked metadata (its data files holding what it places there)
    and the plan."""
    meta = read_metadata(source)
    check_data_files(source, meta)
    _check_record(source, meta)
    return meta, plan_dcp_hf(meta, shown(source), dtype, shard)


def _check_record(source: Path, meta: DcpMetadata) -> None:
    """A save of mpitailor's DCP checkpointer: a partial one holds some layers only (an HF
    model of them would lack the rest: refused), and a full one's files are checked against
    the sizes and CRC-32s its record took (a damaged file is not exported)."""
    from mpitailor.jobs.dcp_save_checks import check_recorded
    record = read_dcp_save_record(source)
    if record is None:
        return
    if record.partial:
        layers = ", ".join(sorted(record.layers))[:120]
        raise UserError(f"{shown(source)}: a partial save (layers {layers}), "
                        f"not a whole model; export the save dir (mpitailor export "
                        f"{shown(source.parent)} ...: the newest copy of every layer)")
    check_recorded(source, record, meta)


def _lay_out(plan: DcpHfPlan, config: Path, root: Path) -> dict:
    """Rank 0 only: the config and tokenizer files, and every weights file created at its
    final size with its header (fsynced: the ranks write only its data); {file: record}
    of the side files."""
    records = _side_files(plan, config, root)
    fds = {}
    try:
        for f in plan.weights.files:
            fds[f.name] = create_sized(root / f.name, f.size, f.prefix)
        fsync_close(fds)
    finally:
        close_all(fds)
    return records


def _side_files(plan: DcpHfPlan, config: Path, root: Path) -> dict:
    """--config's config.json (saying the dtype written) and tokenizer files, as the ZeRO
    export writes them (engine/hf_weights.py: write_side_files)."""
    records = {}
    tensors = [(p.name, p.shape) for f in plan.weights.files for p in f.pieces]
    for name, src in side_files(None, config).items():
        if name == "config.json":
            doc = read_config(src, "give the model's own config.json", follow=True)
            warn_if_another_model(src, doc, tensors)
            for key in ("torch_dtype", "dtype"):
                if key in doc or key == "dtype":
                    doc[key] = DTYPES[plan.weights.dtype].torch
            records[name] = write_synced(root / name, json.dumps(doc, indent=2).encode())
        else:
            records[name] = write_synced(root / name, read_small(
                src, MAX_SIDE_FILE_BYTES, "a model's tokenizer file"))
    return records


def _joined(plan: DcpHfPlan, gathered: dict[str, list]) -> dict:
    """Rank 0: every weights file's record, its CRC-32 joined from its header's and the
    ranks' ranges (which must tile its data)."""
    out = {}
    for f in plan.weights.files:
        crc, end = join_crcs(gathered.get(f.name, []), crc32(f.prefix), len(f.prefix))
        if end != f.size:
            raise RuntimeError(f"internal error: {f.name}: bytes from {end} on written by "
                               f"no rank (a bug in the work split)")
        out[f.name] = {"bytes": f.size, "crc32": f"{crc:08x}"}
    return out
