"""`--dry-run`: the plan in words and bytes (layer -> source; reads and writes per rank)."""
from __future__ import annotations

from mpitailor.formats.zero import ELEMENT
from mpitailor.planning import program
from mpitailor.planning.plan import MergePlan


def format_plan(plan: MergePlan, mpi_size: int) -> str:
    base = plan.base_meta
    lines = [f"output       {plan.output}",
             f"tag          {base.files.tag}   world size {plan.source_world_size}   "
             f"base {plan.base} (step {base.global_steps})",
             "sources"]
    width = max(10, *(len(name) for name, _ in plan.sources)) + 2
    lines += [f"  {name:<{width}} step {m.global_steps:<8} {m.path}" for name, m in plan.sources]
    lines.append(f"{'layer':<12}{'source':<{width}}step")
    lines += [f"{key:<12}{src:<{width}}{plan.meta(src).global_steps}"
              for key, src in plan.layer_source]
    mixed = [g for g, sg in enumerate(plan.subgroups) if sg.step_rule != "single source"]
    lines.append(f"sub-groups   {len(plan.subgroups)}, {len(mixed)} mixing sources"
                 + (f" (Adam step by rule '{plan.subgroups[mixed[0]].step_rule}': for exact "
                    f"steps, train with one param group per layer: per_layer_param_groups, "
                    f"or LayerwiseTrainer's default)"
                    if mixed else " (every Adam step exact)"))
    if plan.target is not None:
        lines.append(f"resharding   {plan.source_world_size} -> {plan.out_world_size} ranks "
                     f"({len(plan.target.layout.subgroup_sizes)} sub-groups at the new size)")
        return "\n".join(lines)
    per_part = plan.bytes_per_partition()
    write_part = sum(per_part.values())
    lines.append("per output partition: reads " + ", ".join(
        f"{n} {human(b)}" for n, b in per_part.items()) + f"; writes {human(write_part)}"
        " (+ small model-states file)")
    lines += _rank_table(plan, mpi_size)
    return "\n".join(lines)


def _rank_table(plan: MergePlan, mpi_size: int) -> list[str]:
    """What each MPI rank copies (program.split): the partitions it writes into (* where it
    writes only part of one), the bytes it reads and writes."""
    bufs = program.buffers(plan)
    work = program.split(bufs, mpi_size)
    pieces: dict[int, dict] = {}
    whole: dict[int, int] = {}
    for b in bufs:
        whole[b.unit] = whole.get(b.unit, 0) + b.nbytes
    lines = [f"{'mpi rank':<10}{'partitions':<20}{'reads':>12}{'writes':>12}"]
    for r, tasks in enumerate(work):
        parts: dict[int, int] = {}
        reads = 0
        for t in tasks:
            b = bufs[t.buffer]
            parts[b.unit] = parts.get(b.unit, 0) + t.hi - t.lo
            if b.unit not in pieces:
                pieces[b.unit] = program.pieces(plan, b.unit)
            reads += ELEMENT * sum(p.length for p in program.clip(
                pieces[b.unit].get(b.subgroup, []), t.lo // ELEMENT, t.hi // ELEMENT))
        span = ",".join(f"{p}{'' if n == whole[p] else '*'}" for p, n in parts.items())
        lines.append(f"{r:<10}{span or '(idle)':<20}{human(reads):>12}"
                     f"{human(sum(parts.values())):>12}")
    return lines


def human(n: float) -> str:
    """Bytes in binary units: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
