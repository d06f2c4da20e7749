"""From the runs' records to the numbers of the table. No I/O, no training.

Per failure (a policy, failure after step F, resumed from a checkpoint of step b <= F; for
a composite, b is the step of its newest part):
  staleness   F - b: the steps between the save and the failure, replayed after the resume.
  excess      what resuming from this checkpoint costs beyond replaying those steps: the
              resumed run's held-out loss minus the uninterrupted run's at the same steps,
              averaged over the scored steps in (F, F + horizon], divided by the rate at
              which the uninterrupted run's held-out loss falls around F (least-squares
              slope over F +- slope_window). In steps; 0 for an exact replay.
  lost        staleness + excess: the steps the resumed run needs after resuming to get back
              to the uninterrupted run's held-out loss at F, with the uninterrupted curve
              taken as straight around F (a single held-out score wiggles by as much as
              20-60 steps of progress here, so the first crossing of the raw curves is
              reported too, but is not what the comparison rests on).
  crossing    the raw version: first step t at which the resumed run's held-out loss is
              <= the uninterrupted run's at F (linear between scored steps), minus b; when it
              never is by the end of the resumed run, that end minus b and `censored`.
  gap_end     held-out loss gap at equal steps, mean over the last `tail` scored steps up to
              F + horizon (nats per byte).
Per policy and seed, from its save schedule in the uninterrupted run:
  expected_staleness  mean of F - (newest save <= F) over every F from its first save on:
              the staleness of a failure at a uniformly random step.
  expected_lost       expected_staleness + the seed's mean excess.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Failure:
    seed: int
    saver: str
    failure: int
    base: int
    staleness: int
    excess: float
    lost: float
    crossing: float
    censored: bool
    gap_end: float
    exact_replay: bool       # every train loss equals the uninterrupted run's


def first_crossing(points: list[tuple[int, float]], target: float) -> float | None:
    """First step at which the piecewise-linear curve through `points` is <= target."""
    if points[0][1] <= target:
        return float(points[0][0])
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v1 <= target:
            return s0 + (v0 - target) / (v0 - v1) * (s1 - s0)
    return None


def slope(evals: dict[int, float], lo: int, hi: int) -> float:
    """Least-squares slope of the held-out loss over steps lo..hi (loss per step)."""
    pts = [(s, v) for s, v in evals.items() if lo <= s <= hi]
    mx = statistics.fmean(s for s, _ in pts)
    my = statistics.fmean(v for _, v in pts)
    num = sum((s - mx) * (v - my) for s, v in pts)
    return num / sum((s - mx) ** 2 for s, _ in pts)


def failure_record(seed: int, saver: str, f: int, unint: dict, res: dict, tail: int = 3,
                   slope_window: int = 150) -> Failure:
    """The numbers of one resumed run (res) against the uninterrupted one (unint)."""
    base, evals, ref = res["base_step"], res["evals"], unint["evals"]
    after = sorted(s for s in evals if s > f)
    gaps = [evals[s] - ref[s] for s in after]
    rate = -slope(ref, f - slope_window, f + slope_window)
    excess = statistics.fmean(gaps) / rate if rate > 0 else math.nan
    points = [(base, res["loaded_eval"])] + sorted((s, v) for s, v in evals.items() if s > base)
    hit = first_crossing(points, ref[f])
    crossing = (hit if hit is not None else max(res["losses"])) - base
    exact = all(v == unint["losses"][s] for s, v in res["losses"].items())
    return Failure(seed, saver, f, base, f - base, excess, f - base + excess, crossing,
                   hit is None, statistics.fmean(gaps[-tail:]), exact)


def seed_failures(record: dict) -> list[Failure]:
    out = []
    for key, res in record["resumed"].items():
        saver, f = key.split("|")
        out.append(failure_record(record["seed"], saver, int(f), record["train"], res))
    return out


def expected_staleness(save_steps: list[int], steps: int) -> float:
    """Mean staleness of a failure at a uniformly random step from the first save on."""
    total, n = 0, 0
    for a, b in zip(save_steps, [*save_steps[1:], steps + 1]):
        d = b - a
        total += d * (d - 1) // 2
        n += d
    return total / n


def saver_costs(record: dict, saver: str, steps: int) -> dict:
    """Bytes written and seconds blocked saving per 1000 steps of the uninterrupted run;
    number of saves, mean interval, expected staleness."""
    log = record["train"]["saves"][saver]
    s = log["steps"]
    return {"mb_per_1k": sum(log["bytes"]) / 1e6 * 1000 / steps,
            "blocked_s_per_1k": sum(log["seconds"]) * 1000 / steps,
            "saves": len(s), "interval": (s[-1] - s[0]) / max(1, len(s) - 1),
            "expected_staleness": expected_staleness(s, steps)}


def mean_spread(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


FIELDS = ("staleness", "excess", "lost", "crossing", "gap_end")


def summarize(records: list[dict], savers: list[str], steps: int) -> dict:
    """Per saver: mean and spread over seeds of each seed's mean over its failures (and
    per failure position: mean and spread over seeds); costs from the save schedules."""
    fails = [f for r in records for f in seed_failures(r)]
    rows = {}
    for name in savers:
        mine = [f for f in fails if f.saver == name]
        per_seed: dict[int, list[Failure]] = {}
        for f in mine:
            per_seed.setdefault(f.seed, []).append(f)
        row = {k: mean_spread([statistics.fmean(getattr(f, k) for f in fs)
                               for fs in per_seed.values()]) for k in FIELDS}
        row.update(n=len(mine), censored=sum(f.censored for f in mine),
                   exact_replay=sum(f.exact_replay for f in mine))
        row["by_position"] = by_position(per_seed)
        if name in records[0]["train"]["saves"]:
            costs = {r["seed"]: saver_costs(r, name, steps) for r in records}
            for key in next(iter(costs.values())):
                row[key] = mean_spread([c[key] for c in costs.values()])
            row["expected_lost"] = mean_spread(
                [costs[s]["expected_staleness"] + statistics.fmean(f.excess for f in fs)
                 for s, fs in per_seed.items()])
        rows[name] = row
    return {"rows": rows, "failures": [asdict(f) for f in fails]}


def by_position(per_seed: dict[int, list[Failure]]) -> list[dict]:
    """Early, middle, late: mean and spread over seeds of lost and excess."""
    ordered = [sorted(fs, key=lambda f: f.failure) for fs in per_seed.values()]
    return [{k: mean_spread([getattr(fs[i], k) for fs in ordered]) for k in ("lost", "excess")}
            for i in range(min(len(fs) for fs in ordered))]


def paired(records: list[dict], a: str, b: str, steps: int) -> dict:
    """a minus b per seed (same failures): lost (mean over the seed's failures) and
    expected_lost; mean, spread, and in how many seeds a is below b."""
    fails = [f for r in records for f in seed_failures(r)]
    out = {}
    diffs: dict[str, list[float]] = {"lost": [], "expected_lost": []}
    for r in records:
        mine = {(f.failure, f.saver): f for f in fails if f.seed == r["seed"]}
        fa = [mine[f, a] for f, n in mine if n == a and (f, b) in mine]
        diffs["lost"].append(statistics.fmean(x.lost - mine[x.failure, b].lost for x in fa))
        exp = {n: saver_costs(r, n, steps)["expected_staleness"] for n in (a, b)}
        diffs["expected_lost"].append(
            exp[a] + statistics.fmean(x.excess for x in fa) - exp[b]
            - statistics.fmean(mine[x.failure, b].excess for x in fa))
    for k, ds in diffs.items():
        m, s = mean_spread(ds)
        out[k] = {"mean": m, "spread": s, "seeds_below": sum(d < 0 for d in ds),
                  "seeds": len(ds)}
    return out
