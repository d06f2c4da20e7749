"""The "Engine v2" goals, judged from merge_bench's medians (see bench/merge_bench.py).

- copy:    a 1-rank parity merge within 1.25x of copying the same output bytes, warm and
           cold, on W=4 (2.25 GB) and on the >= 2.8 GB checkpoint (W=1);
- ranks:   2 ranks at least 1.8x faster than 1 (merge), on W=4 and on W=1;
- reshard: resharding to 16 at no less than 0.8x the plain merge's throughput (GB written/s),
           from W=4, at each rank count and cache state run;
- rss:     the peak RSS of every rank under 0.5 GB (1e9 bytes) in every merge and reshard
           case, at W=1, 4, 8 and 16.
A required world size missing from the run is reported as "not run".
"""
from __future__ import annotations

COPY_MAX, RANKS_MIN, RESHARD_MIN, RSS_MAX = 1.25, 1.8, 0.8, 0.5e9
REQUIRED = {"copy": (4, 1), "ranks": (4, 1), "reshard": (4,), "rss": (1, 4, 8, 16)}
ENGINE_CASES = ("merge", "reshard")


def evaluate(summary: list[dict]) -> list[dict]:
    """One record per checked goal instance: goal, what, value, limit, ok (None: not run)."""
    by = {(x["world"], x["case"], x["ranks"], x["cold"]): x for x in summary}
    worlds = sorted({x["world"] for x in summary})
    caches = sorted({x["cold"] for x in summary}, reverse=True)  # cold first
    out: list[dict] = []
    for w in _with_required(worlds, "copy"):
        for cold in caches:
            m, c = by.get((w, "merge", 1, cold)), by.get((w, "copy", 1, cold))
            what = f"W={w}{_size(m)} 1-rank merge / copy, {_cache(cold)}"
            out.append(_check("copy", what, m and c and c["gb_per_s"] / m["gb_per_s"],
                              COPY_MAX, "<="))
    for w in _with_required(worlds, "ranks"):
        for cold in caches:
            one, two = by.get((w, "merge", 1, cold)), by.get((w, "merge", 2, cold))
            what = f"W={w}{_size(one)} merge 2 ranks vs 1, {_cache(cold)}"
            out.append(_check("ranks", what, one and two and one["seconds"] / two["seconds"],
                              RANKS_MIN, ">="))
    resharded = sorted({(x["world"], x["out_world"], x["ranks"], x["cold"]) for x in summary
                        if x["case"] == "reshard"}, key=lambda k: (k[0], k[2], not k[3]))
    for w in REQUIRED["reshard"]:
        if not any(k[0] == w for k in resharded):
            out.append(_check("reshard", f"W={w} reshard vs merge throughput", None,
                              RESHARD_MIN, ">="))
    for w, w2, ranks, cold in resharded:
        r, m = by[(w, "reshard", ranks, cold)], by.get((w, "merge", ranks, cold))
        what = f"W={w}->{w2} reshard / merge GB/s, {ranks} rank(s) {_cache(cold)}"
        out.append(_check("reshard", what, m and r["gb_per_s"] / m["gb_per_s"],
                          RESHARD_MIN, ">="))
    for w in _with_required(worlds, "rss"):
        for case in ENGINE_CASES:
            mine = [x for x in summary if x["world"] == w and x["case"] == case]
            if not mine and (case == "reshard" or w not in REQUIRED["rss"]):
                continue
            worst = max(mine, key=lambda x: x["peak_rss_gb"], default=None)
            where = f" (worst: {worst['ranks']} rank(s) {_cache(worst['cold'])}, per rank " \
                f"{'/'.join(f'{g:.2f}' for g in worst['peak_rss_ranks_gb'])} GB)" if worst else ""
            out.append(_check("rss", f"W={w} {case} peak RSS of any rank{where}",
                              worst and worst["peak_rss_gb"] * 1e9, RSS_MAX, "<"))
    return out


def _with_required(worlds: list[int], goal: str) -> list[int]:
    need = REQUIRED[goal]  # required ones first, in the order
    return sorted(set(worlds) | set(need), key=lambda w: (need.index(w) if w in need else
                                                          len(need), w))


def _size(x: dict | None) -> str:
    return f" ({x['input_gb']:.2f} GB)" if x else ""


def _cache(cold: bool) -> str:
    return "cold" if cold else "warm"


def _check(goal: str, what: str, value: float | None, limit: float, op: str) -> dict:
    ok = None if value is None else {"<=": value <= limit, ">=": value >= limit,
                                     "<": value < limit}[op]
    return {"goal": goal, "what": what, "value": value, "limit": limit, "op": op, "ok": ok}


def print_goals(goals: list[dict]) -> None:
    print("Engine v2 goals (medians):")
    for g in goals:
        verdict = {True: "PASS", False: "FAIL", None: "not run"}[g["ok"]]
        if g["value"] is None:
            shown = "-"
        elif g["goal"] == "rss":
            shown = f"{g['value'] / 1e9:.2f} GB {g['op']} {g['limit'] / 1e9:.2f} GB"
        else:
            shown = f"{g['value']:.2f}x {g['op']} {g['limit']:.2f}x"
        print(f"  {verdict:<8}{g['goal']:<8}{shown:<22}{g['what']}")
