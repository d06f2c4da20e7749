"""The study's outputs: table (markdown), JSON and figures, from the seeds' records.

Everything here is computed from OUT/plan.json and OUT/runs/seed*.json, so
`python -m bench.quality.run --report-only` rebuilds it without training anything.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from bench.quality import metrics, plots
from bench.quality.spec import Model
from bench.quality.study import Plan, int_keys, save_json

log = logging.getLogger(__name__)


def budgets_of(savers) -> list[list[str]]:
    """Saver names grouped by budget K, the full saver first."""
    groups: dict[int, list[str]] = {}
    for name, _, k in savers:
        groups.setdefault(k, []).append(name)
    return list(groups.values())


def write(out: Path, plan: Plan, cal: dict, info: dict, records: list[dict], wall: float,
          command: str) -> None:
    names = [s[0] for s in plan.savers] + ["identity"]
    rows = metrics.summarize(records, names, plan.steps)
    budgets = budgets_of(plan.savers)
    comparisons = {f"{n} vs {g[0]}": metrics.paired(records, n, g[0], plan.steps)
                   for g in budgets for n in g[1:]}
    identity = identity_check(records)
    replay = out / "blocked.json"  # bench.quality.blocked: asynchronous saves, one seed
    blocked = json.loads(replay.read_text()) if replay.exists() else None
    table = render(rows["rows"], budgets, comparisons, identity, plan, len(records), command,
                   wall, blocked)
    print(table)
    (out / "table.md").write_text(table)
    save_json(out / "quality.json", {
        "command": command, "wall_seconds": wall, "plan": asdict(plan), "corpus": info,
        "calibration": cal, "rows": rows["rows"], "comparisons": comparisons,
        "identity": identity, "failures": rows["failures"]})
    plots.curves(records, out / "curves.png")
    plots.tradeoff({k: v for k, v in rows["rows"].items() if k != "identity"},
                   out / "tradeoff.png")
    plots.gaps(records, budgets, plan.model.eval_every, out / "gaps.png")
    first = records[0]
    plots.around_failures(first, [g + (["identity"] if i == 0 else [])
                                  for i, g in enumerate(budgets)],
                          plan.horizon, out / f"around-failure-seed{first['seed']}.png")
    log.info("wrote %s", out)


def rewrite(out: Path) -> None:
    """The outputs again from what a finished study left in `out`."""
    saved = json.loads((out / "plan.json").read_text())
    raw = dict(saved["plan"])
    model = Model(**raw.pop("model"))
    for k in ("savers", "estimates"):
        raw[k] = tuple(tuple(x) for x in raw[k])
    raw["failure_fractions"] = tuple(raw["failure_fractions"])
    plan = Plan(model, **raw)
    records = []
    for seed in range(saved["seeds"]):
        r = json.loads((out / "runs" / f"seed{seed}.json").read_text())
        r["train"] = int_keys(r["train"])
        r["resumed"] = {k: int_keys(v) for k, v in r["resumed"].items()}
        records.append(r)
    wall = max(r["finished"] for r in records) - saved["started"]
    write(out, plan, saved["calibration"], saved["corpus"], records, wall, saved["command"])


def identity_check(records: list[dict]) -> dict:
    """Does the composite of the newest full save resume loss for loss like the save itself
    (and both like the uninterrupted run)?"""
    same_as_save, same_as_run, n = 0, 0, 0
    for r in records:
        for key, res in r["resumed"].items():
            if not key.startswith("identity|"):
                continue
            f = key.split("|")[1]
            full = next(v for k, v in r["resumed"].items()
                        if k.endswith(f"|{f}") and k.startswith("full@"))
            n += 1
            same_as_save += res["losses"] == full["losses"] and res["evals"] == full["evals"] \
                and res["loaded_eval"] == full["loaded_eval"]
            same_as_run += all(v == r["train"]["losses"][s] for s, v in res["losses"].items())
    return {"resumes": n, "equal_to_full_save": same_as_save,
            "equal_to_uninterrupted": same_as_run}


def fmt(ms, digits: int = 1) -> str:
    m, s = ms
    return "-" if m != m else f"{m:.{digits}f} ± {s:.{digits}f}"


HEADER = ("| policy | budget | saves | interval | MB/1k steps | vs full | s blocked/1k "
          "| staleness | excess | **lost** | raw crossing | gap@F+H (nats) | expected lost |")


def async_cell(row: dict | None) -> str:
    """The replay's blocked seconds per 1000 steps of an asynchronous saver; "-" otherwise."""
    return f"{row['blocked_s_per_1k']:.2f} | " if row and row["asynchronous"] else "- | "


def render(rows, budgets, comparisons, identity, plan: Plan, seeds: int, command: str,
           wall: float, blocked: dict | None = None) -> str:
    header = HEADER if blocked is None else HEADER.replace(
        "| s blocked/1k ", "| s blocked/1k | async s blocked/1k ")
    lines = [f"`{command}` ({wall / 60:.0f} min wall)", "",
             f"{seeds} seeds x {len(plan.failure_fractions)} failures, {plan.steps} steps; "
             f"layer-wise resumes train to F + {plan.horizon}, full-save resumes to "
             f"F + {plan.check}. Mean ± sd over seeds (of each seed's mean over its "
             f"failures); steps unless marked."]
    if blocked is not None:
        lines.append(f"async s blocked/1k: the layer-wise saves made asynchronously (slices "
                     f"copied while the next step runs), seed {blocked['seed']} replayed at "
                     f"the study's own save steps (`{blocked['command'].strip()}`); the column "
                     f"before it is the study's synchronous figure.")
    lines += ["", header, "|" + "---|" * (header.count("|") - 1)]
    for group in budgets:
        full_mb = rows[group[0]]["mb_per_1k"][0]
        for name in group:
            r = rows[name]
            policy, k = name.split("@")
            cens = f" ({r['censored']} never)" if r["censored"] else ""
            lines.append(
                f"| {policy} | full@{k} | {r['saves'][0]:.0f} | {r['interval'][0]:.1f} | "
                f"{fmt(r['mb_per_1k'], 0)} | {r['mb_per_1k'][0] / full_mb:.3f} | "
                f"{fmt(r['blocked_s_per_1k'], 2)} | "
                + (async_cell(blocked["rows"].get(name)) if blocked is not None else "")
                + f"{fmt(r['staleness'])} | "
                f"{fmt(r['excess'])} | **{fmt(r['lost'])}** | {fmt(r['crossing'])}{cens} | "
                f"{fmt(r['gap_end'], 4)} | {fmt(r['expected_lost'])} |")
    lines += ["", "Lost steps (and excess) by failure position, mean ± sd over seeds:", "",
              "| policy | budget | early | middle | late |", "|---|---|---|---|---|"]
    for group in budgets:
        for name in group:
            policy, k = name.split("@")
            cells = [f"{fmt(p['lost'])} ({fmt(p['excess'])})" for p in rows[name]["by_position"]]
            lines.append(f"| {policy} | full@{k} | " + " | ".join(cells) + " |")
    lines += ["", "Paired by seed (layer-wise minus full at the same budget, same failures; "
              "negative: the layer-wise policy loses fewer steps):", ""]
    for k, c in comparisons.items():
        lost, exp = c["lost"], c["expected_lost"]
        lines.append(f"- {k}: lost {lost['mean']:+.1f} ± {lost['spread']:.1f} (lower in "
                     f"{lost['seeds_below']} of {lost['seeds']} seeds); expected lost "
                     f"{exp['mean']:+.1f} ± {exp['spread']:.1f} (lower in {exp['seeds_below']} "
                     f"of {exp['seeds']})")
    n = identity["resumes"]
    lines += ["", f"Identity control: {identity['equal_to_full_save']} of {n} resumes from "
              f"`recover`'s composite of the newest full save equal the resume from the save "
              f"itself, loss for loss (train and held-out); {identity['equal_to_uninterrupted']}"
              f" of {n} equal the uninterrupted run's train losses.", ""]
    return "\n".join(lines)
