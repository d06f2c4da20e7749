"""The study's figures (matplotlib, PNG). Reads records and the summary; trains nothing."""
from __future__ import annotations

import statistics
from pathlib import Path

COLORS = {"full": "black", "identity": "gray", "parity": "tab:blue", "filter": "tab:orange",
          "adaptive": "tab:green"}
POSITIONS = ("early", "middle", "late")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def policy_of(saver: str) -> str:
    return saver.split("@")[0]


def curves(records: list[dict], path: Path) -> None:
    """The uninterrupted runs' held-out loss, failure points marked: still falling?"""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    top, bottom = 0.0, float("inf")
    start = 150 if max(records[0]["train"]["evals"]) > 600 else 0  # the first steps: off the top
    for r in records:
        ev = r["train"]["evals"]
        steps = sorted(ev)
        line, = ax.plot(steps, [ev[s] for s in steps], lw=0.8, label=f"seed {r['seed']}")
        for f in r["failures"]:
            ax.axvline(f, color=line.get_color(), ls=":", lw=0.6)
        top = max(top, ev[min(s for s in steps if s >= start)])
        bottom = min(bottom, min(ev.values()))
    ax.set_ylim(bottom - 0.05, top + 0.05)
    ax.set_xlim(left=start)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(f"uninterrupted runs (from step {start}); dotted: each seed's failure points")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def around_failures(record: dict, budgets: list[list[str]], horizon: int, path: Path) -> None:
    """One seed: held-out loss of every resumed run around each failure, against the
    uninterrupted run (rows: byte budgets, columns: failure points)."""
    plt = _plt()
    fails = record["failures"]
    fig, axes = plt.subplots(len(budgets), len(fails), figsize=(4.2 * len(fails),
                                                                  3.2 * len(budgets)),
                             squeeze=False)
    ev = record["train"]["evals"]
    for row, savers in enumerate(budgets):
        for col, f in enumerate(fails):
            ax = axes[row][col]
            lo = min(record["resumed"][f"{s}|{f}"]["base_step"] for s in savers
                     if f"{s}|{f}" in record["resumed"]) - 20
            steps = [s for s in sorted(ev) if lo <= s <= f + horizon]
            ax.plot(steps, [ev[s] for s in steps], color="k", lw=2.5, alpha=0.25,
                    label="uninterrupted")
            for s in savers:
                res = record["resumed"].get(f"{s}|{f}")
                if res is None:
                    continue
                pts = [(res["base_step"], res["loaded_eval"])] + sorted(res["evals"].items())
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1,
                        color=COLORS.get(policy_of(s)), marker=".", ms=3, label=s)
            ax.axvline(f, color="red", ls=":", lw=1)
            ax.axhline(ev[f], color="red", ls=":", lw=0.6)
            ax.set_title(f"{POSITIONS[col] if col < 3 else col}: failure after step {f}",
                         fontsize=9)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel(f"held-out loss ({savers[0]} budget)", fontsize=8)
                ax.legend(fontsize=6)
    fig.suptitle(f"seed {record['seed']}: resumed after a failure (red: step and loss at "
                 f"the failure)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def gaps(records: list[dict], budgets: list[list[str]], every: int, path: Path) -> None:
    """Held-out loss minus the uninterrupted run's at the same step, against steps since
    the failure (in bins of `every`: failures fall at other steps in each seed), mean over
    seeds (rows: byte budgets, columns: failure positions)."""
    plt = _plt()
    n_pos = len(records[0]["failures"])
    fig, axes = plt.subplots(len(budgets), n_pos, figsize=(4.2 * n_pos, 3 * len(budgets)),
                             squeeze=False, sharey="row")
    for row, savers in enumerate(budgets):
        for col in range(n_pos):
            ax = axes[row][col]
            for s in savers:
                by_offset: dict[int, list[float]] = {}
                for r in records:
                    f = r["failures"][col]
                    res = r["resumed"].get(f"{s}|{f}")
                    if res is None:
                        continue
                    ev = r["train"]["evals"]
                    for t, v in res["evals"].items():
                        if t in ev:
                            bin_ = round((t - f) / every) * every
                            by_offset.setdefault(bin_, []).append(v - ev[t])
                xs = sorted(by_offset)
                ax.plot(xs, [statistics.fmean(by_offset[x]) for x in xs], lw=1,
                        color=COLORS.get(policy_of(s)), label=s)
            ax.axvline(0, color="red", ls=":", lw=1)
            ax.axhline(0, color="k", lw=0.5)
            ax.set_title(f"{POSITIONS[col] if col < 3 else col} failure", fontsize=9)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel(f"loss - uninterrupted ({savers[0]} budget)", fontsize=8)
                ax.legend(fontsize=6)
            if row == len(budgets) - 1:
                ax.set_xlabel("steps since the failure", fontsize=8)
    fig.suptitle("held-out loss gap to the uninterrupted run, mean over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def tradeoff(rows: dict, path: Path) -> None:
    """Steps lost per failure against bytes written per 1000 steps, a line per policy: at
    the failures run, and expected at a uniformly random failure step."""
    plt = _plt()
    panels = (("lost", "steps lost per failure (the failures run)"),
              ("expected_lost", "expected steps lost (uniform failure step)"),
              ("excess", "excess: lost - staleness"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    by_policy: dict[str, list[str]] = {}
    for name in rows:
        by_policy.setdefault(policy_of(name), []).append(name)
    for ax, (field, label) in zip(axes, panels):
        for policy, names in by_policy.items():
            pts = sorted((rows[n]["mb_per_1k"][0], rows[n][field]) for n in names)
            ax.errorbar([p[0] for p in pts], [p[1][0] for p in pts],
                        yerr=[p[1][1] for p in pts], color=COLORS.get(policy), marker="o",
                        ms=4, capsize=3, lw=1, label=policy)
        ax.set_xlabel("MB written per 1000 steps (measured)")
        ax.set_ylabel(f"{label}\n(mean ± sd over seeds)", fontsize=8)
        ax.axhline(0, color="k", lw=0.4)
        ax.legend(fontsize=8)
    fig.suptitle("what the bytes buy: training lost per failure at each byte budget",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
