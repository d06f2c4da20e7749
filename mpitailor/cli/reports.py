"""`diff` and `inspect` reports as text tables (their --json is the report as it is)."""
from __future__ import annotations

from mpitailor.display import shown
from mpitailor.planning.layers import layer_runs
from mpitailor.planning.plan_report import human


def format_table(rep: dict) -> str:
    kind = rep["kind"] + (" (only the layers below were saved)" if rep["kind"] == "partial"
                          else "")
    lines = [
        f"checkpoint   {shown(rep['path'])}",
        f"kind         {kind}",
        f"world size   {rep['world_size']}   ZeRO stage {rep['zero_stage']}   dtype {rep['dtype']}"
        f"   step {rep['global_steps']}"
        f"   samples {rep['global_samples']}   deepspeed {rep['ds_version']}",
        f"optimizer    {len(rep['param_groups'])} param group(s), {rep['subgroups']} "
        f"sub-group(s), {human(rep['optimizer_bytes_per_rank'])} per rank",
    ]
    if rep["tied"]:
        lines.append("tied         " + ", ".join(f"{a} -> {b}" for a, b in rep["tied"].items()))
    if rep.get("newer_saves"):  # inspect SAVE_DIR shows what `latest` names
        lines.append(f"newer saves  {', '.join(rep['newer_saves'])} (after the one `latest` "
                     f"names; `mpitailor recover` assembles the newest copy of every layer)")
    if rep.get("globals"):  # what DeepSpeed's own loader will import to load the model states
        lines.append("carries      " + ", ".join(rep["globals"]))
    origin = rep["kind"] == "composite"
    header = (f"{'layer':<12}{'params':>8}{'frozen':>8}{'elements':>12}{'bytes/rank':>12}  "
              f"{'sub-groups':<12}" + ("  from (step)" if origin else ""))
    lines.append(header.rstrip())
    for key, row in rep["layers"].items():
        subs = row["subgroups"]
        span = ",".join(r for r, _ in layer_runs((g, None) for g in subs)) or "-"
        came = f"  {row['from']} ({row['from_step']})" if origin and "from" in row else ""
        lines.append(f"{key:<12}{row['params']:>8}{row['frozen']:>8}{row['elements']:>12}"
                     f"{human(row['bytes_per_rank']):>12}  {span:<12}{came}".rstrip())
    return "\n".join(lines)


def format_dcp_table(rep: dict) -> str:
    lines = [
        f"checkpoint   {shown(rep['path'])}",
        f"kind         PyTorch Distributed Checkpoint; {rep['layout']}",
        f"world size   {rep['world_size']} ({rep['data_files']} data files)   dtype "
        f"{rep['dtype']}   {human(rep['bytes'])} of tensors   DCP {rep['version']}",
        f"optimizer    param groups {rep['param_groups']}",
    ]
    if rep.get("save"):
        save = rep["save"]
        held = f" of {', '.join(shown(k) for k in save['layers'])}" if save["layers"] else ""
        lines.insert(2, f"save         {save['kind']} save{held}, step {save['step']} "
                        f"(mpitailor's DcpCheckpointer)")
    if rep["other_entries"]:
        lines.append(f"other        {len(rep['other_entries'])} entries (the trainer's own): "
                     + ", ".join(shown(e) for e in rep["other_entries"][:6])
                     + (", ..." if len(rep["other_entries"]) > 6 else ""))
    lines.append(f"{'layer':<12}{'params':>8}{'elements':>12}{'model':>10}{'optimizer':>11}"
                 f"  optimizer state")
    for key, row in rep["layers"].items():
        lines.append(f"{shown(key):<12}{row['params']:>8}{row['elements']:>12}"
                     f"{human(row['model_bytes']):>10}{human(row['optimizer_bytes']):>11}  "
                     f"{', '.join(row['optimizer_state']) or '-'}".rstrip())
    return "\n".join(lines)


def format_dcp_saves(rep: dict) -> str:
    """`inspect SAVE_DIR` of a dir of DCP saves (jobs/inspect_dcp.py: saves_report)."""
    lines = [f"save dir     {shown(rep['path'])}",
             f"kind         PyTorch Distributed Checkpoint saves ({len(rep['saves'])} found)",
             f"{'save':<16}{'step':>6}  {'kind':<8} {'holds':<40} state"]
    for s in rep["saves"]:
        holds = "every entry" if s["kind"] == "full" else \
            ", ".join(shown(k) for k in s["layers"]) if s["layers"] else "-"
        state = "ok" if s["problem"] is None else \
            ("cannot be read now: " if s["unreadable"] else "not usable: ") + s["problem"]
        lines.append(f"{shown(s['name']):<16}{s['step']:>6}  {s['kind']:<8} {holds[:40]:<40} "
                     f"{state[:160]}")
    rec = rep["recover"]
    if "refused" in rec:
        lines.append(f"recover      refuses: {rec['refused']}")
        return "\n".join(lines)
    lines.append(f"recover      step {rec['step']}: {', '.join(map(shown, rec['sources']))} "
                 f"(the newest copy of every layer; CRC-32s not read here)")
    by_save: dict[str, list[str]] = {}
    for layer, save in rec["layers"].items():
        by_save.setdefault(save, []).append(shown(layer))
    for save, layers in by_save.items():
        lines.append(f"  from {shown(save)}: {', '.join(layers)}")
    if not by_save:
        lines.append(f"  from {shown(rec['full'])}: every entry")
    else:  # (the rest of the layers from the full save, if it is a source at all)
        if rec["full"] in rec["sources"]:
            lines.append(f"  from {shown(rec['full'])}: every other layer")
        lines.append(f"  from {shown(rec['base'])} (the base): every entry outside the layers "
                     f"(the optimizer's param groups, the trainer's own state)")
    for name, why in rec["skipped"].items():
        lines.append(f"  skipped {shown(name)}: {why[:160]}")
    if rec["pruned"]:
        lines.append(f"  stepped across (pruned): {', '.join(shown(n) for n in rec['pruned'])}")
    if rec.get("rolled_back"):
        lines.append(f"  {rec['rolled_back']}")
    return "\n".join(lines)


def format_diff(rep: dict) -> str:
    lines = [f"A  {rep['a']}", f"B  {rep['b']}",
             f"{'layer':<12}{'kind':<12}{'same':<6}{'max |A-B|':>12}{'|A-B|/|A|':>12}"]
    for key, kinds in rep["layers"].items():
        for kind, d in kinds.items():
            lines.append(f"{key:<12}{kind:<12}{'yes' if d['identical'] else 'NO':<6}"
                         f"{d['max_abs_diff']:>12.4g}{d['rel_norm_diff']:>12.4g}")
    for name, c in rep["counters"].items():
        lines.append(f"{name:<24}{'yes' if c['identical'] else 'NO':<6}A {c['a']}   B {c['b']}")
    if rep["not_compared"]:
        lines.append(f"not compared (not held by both): {', '.join(rep['not_compared'])}")
    lines.append("identical" if rep["identical"] else "different")
    return "\n".join(lines)
