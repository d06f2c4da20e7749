"""`--dry-run` of a DCP merge or recovery: the plan in words and bytes, as plan_report.py
says a ZeRO merge's: each layer key and its source, the bytes taken from each source, the
output's data files (their sizes and the MPI rank that writes each) and world size, and in
link mode which files are linked and what is written. Pure: no I/O."""
from __future__ import annotations

from pathlib import Path

from mpitailor.formats.dcp import METADATA, metadata_bytes
from mpitailor.planning.dcp_link import LinkPlan
from mpitailor.planning.dcp_plan import DcpPlan
from mpitailor.planning.plan_report import human


def format_dcp_plan(plan: DcpPlan, output: Path, paths: dict[str, Path],
                    saves: dict[str, dict], linked: LinkPlan | None,
                    shares: tuple[tuple[str, ...], ...]) -> str:
    """paths: each source's dir; saves: each source's step (source_saves); shares: the
    output data files each MPI rank writes (copy mode)."""
    files = plan.files()
    writers = len(files)
    mode = "link (hard links: no byte of data copied)" if linked is not None else "copy"
    lines = [f"output       {output}",
             f"format       PyTorch Distributed Checkpoint, {mode}",
             (f"world size   {writers} (the sources' data files, one per saving rank; "
             f"dcp.load reshards to any world size)   base {plan.base}"),
             "sources"]
    width = max(10, *(len(name) for name, _ in plan.sources)) + 2
    taken: dict[str, tuple[int, int]] = {}
    for c in plan.copies:
        n, b = taken.get(c.source, (0, 0))
        taken[c.source] = (n + 1, b + c.item.length)
    for name, _ in plan.sources:
        n, b = taken.get(name, (0, 0))
        step = saves.get(name, {}).get("global_steps")
        lines.append(f"  {name:<{width}} step {step if step is not None else '?':<8} "
                     f"{n:>6} items {human(b):>11}   {paths[name]}")
    total = sum(b for _, b in taken.values())
    lines.append(f"  {'total':<{width}} {'':13} {len(plan.copies):>6} items {human(total):>11}")
    lines.append(f"{'layer':<12}{'source':<{width}}step")
    lines += [f"{key:<12}{src:<{width}}{saves.get(src, {}).get('global_steps', '?')}"
              for key, src in plan.layer_source]
    meta = len(metadata_bytes(plan.output if linked is None else linked.output))
    if linked is None:
        rank_of = {name: r for r, names in enumerate(shares) for name in names}
        lines.append(f"{'output file':<24}{'bytes':>12}   mpi rank")
        lines += [f"{name:<24}{human(size):>12}   {rank_of.get(name, '?')}"
                  for name, size in sorted(files.items())]
        lines.append(f"{METADATA:<24}{human(meta):>12}   0 (then the manifest)")
        lines.append(f"writes       {human(sum(files.values()) + meta)} in {writers + 1} files "
                     f"by {len(shares)} rank(s)")
        return "\n".join(lines)
    lines.append(f"{'linked file':<24}{'':12}   from")
    lines += [f"{x.name:<24}{'':12}   {x.source}: {paths[x.source] / x.file}"
              for x in linked.links]
    lines.append(f"link mode    {len(linked.links)} data file(s) hard-linked, no item copied "
                 f"(the output on the sources' file system); written: {METADATA} "
                 f"({human(meta)}) and the manifest")
    return "\n".join(lines)
