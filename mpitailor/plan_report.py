"""`--dry-run`: the plan in words and bytes (layer -> source; reads and writes per rank)."""
from __future__ import annotations

from mpitailor.inspect_ckpt import human
from mpitailor.plan import MergePlan, owned_partitions
from mpitailor.reshard import pieces_for
from mpitailor.zero3.shard import BYTES_PER_ELEMENT


def format_plan(plan: MergePlan, mpi_size: int) -> str:
    base = plan.base_meta
    lines = [f"output       {plan.output}",
             f"tag          {base.files.tag}   world size {plan.world_size}   "
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
        lines.append(f"resharding   {plan.world_size} -> {plan.out_world_size} ranks "
                     f"({len(plan.target.layout.subgroup_sizes)} sub-groups at the new size)")
        lines.append(f"{'mpi rank':<10}{'partitions':<16}{'reads':>12}")
        ps = dict(plan.param_source)
        for r in range(mpi_size):
            mine = owned_partitions(plan.out_world_size, r, mpi_size)
            reads = sum(p.length * BYTES_PER_ELEMENT for part in mine
                        for p in pieces_for(plan.target, part, plan.base_meta.layout, ps))
            lines.append(f"{r:<10}{','.join(map(str, mine)) or '(idle)':<16}{human(reads):>12}")
        return "\n".join(lines)
    per_part = plan.bytes_per_partition()
    write_part = sum(per_part.values())
    lines.append("per output partition: reads " + ", ".join(
        f"{n} {human(b)}" for n, b in per_part.items()) + f"; writes {human(write_part)}"
        " (+ small model-states file)")
    lines.append(f"{'mpi rank':<10}{'partitions':<16}{'reads':>12}{'writes':>12}")
    for r in range(mpi_size):
        mine = owned_partitions(plan.world_size, r, mpi_size)
        span = ",".join(map(str, mine)) if mine else "(idle)"
        lines.append(f"{r:<10}{span:<16}{human(write_part * len(mine)):>12}"
                     f"{human(write_part * len(mine)):>12}")
    return "\n".join(lines)
