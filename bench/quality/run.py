"""Does training resumed from a composite checkpoint end as well as from a full one?

    python -m bench.quality.run [--seeds 3] [--steps 200] [--fail-at 75] [--every 10]

A 4-layer Llama (hidden 128) learns a copy task (8 random tokens, a separator, the same 8
again; only the copy is scored) with real DeepSpeed ZeRO-3 in 2 processes, one optimizer
group per layer. Per seed, side by side:
  uninterrupted   N steps
  full            saves every S steps, fails after step F, resumes from the newest (full) save
  identity        as full, but resumes from `recover`'s composite of that save (must equal full)
  parity/filter/adaptive   layer-wise saves by that policy, fails after F, resumes from the
                  `recover`ed composite of the newest copy of every layer
Reports final train loss (mean of the last 10 steps) and held-out loss (mean and spread over
seeds), and the bytes each policy wrote before the failure against full saves. Writes
bench/out/quality.json and bench/out/quality.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from mpitailor.tinytrain import TrainSpec, launch

OUT = Path(__file__).resolve().parents[1] / "out"
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
POLICIES = {"parity": {"name": "parity"},
            "filter": {"name": "filter", "always": (0, -1), "every": 4},
            "adaptive": {"name": "adaptive", "top_fraction": 0.5, "max_staleness": 3}}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix != ".h5")


def recover(save_dir: Path, out: Path) -> None:
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpitailor", "recover",
                        str(save_dir), "-o", str(out), "-q", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"recover failed: {r.stderr}")


def one_seed(seed: int, args, tmp: Path) -> dict:
    base = TrainSpec(save_dir="", world_size=2, layers=4, hidden=128, intermediate=256,
                     heads=4, kv_heads=4, vocab=32, seq_len=17, micro_batch=8, lr=3e-3,
                     grouping="per_layer", task="copy", eval_batches=8, seed=seed,
                     data_seed=seed, steps=args.steps, save_at=())
    saves = tuple(range(args.every, args.fail_at + 1, args.every))
    last = saves[-1]
    runs = {"uninterrupted": launch(replace(base, save_dir=str(tmp / "a")))}
    out = {"uninterrupted": {**runs["uninterrupted"], "bytes": 0}}
    for kind in ("full", *POLICIES):
        save_dir = tmp / kind
        before = replace(base, save_dir=str(save_dir), steps=args.fail_at, save_at=saves,
                         policy=POLICIES.get(kind))
        pre = launch(before)
        written = du(save_dir)
        starts = {"full": (save_dir, f"global_step{last}")}
        if kind == "full":
            recover(save_dir, tmp / "identity-ckpt")
            starts["identity"] = (tmp / "identity-ckpt", f"global_step{last}")
        else:
            recover(save_dir, tmp / f"{kind}-ckpt")
            starts = {kind: (tmp / f"{kind}-ckpt", f"global_step{last}")}
        for name, (load_dir, tag) in starts.items():
            resumed = launch(replace(base, save_dir=str(tmp / f"{name}-resumed"),
                                     load_dir=str(load_dir), load_tag=tag))
            out[name] = {**resumed, "bytes": written, "pre_losses": pre["losses"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--fail-at", type=int, default=75)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    per_seed = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory(prefix="mpitailor-quality-", dir=OUT) as tmp:
            per_seed.append(one_seed(1000 + seed, args, Path(tmp)))
        print(f"seed {seed} done", flush=True)
    kinds = list(per_seed[0])
    full_bytes = statistics.mean(s["full"]["bytes"] for s in per_seed)
    table = {}
    for k in kinds:
        train = [statistics.mean(s[k]["losses"][-10:]) for s in per_seed]
        held = [s[k]["eval_loss"] for s in per_seed]
        table[k] = {"train_loss": statistics.mean(train), "train_spread": _spread(train),
                    "heldout_loss": statistics.mean(held), "heldout_spread": _spread(held),
                    "bytes_vs_full": (statistics.mean(s[k]["bytes"] for s in per_seed) /
                                      full_bytes) if k != "uninterrupted" else None}
    identical = all(s["identity"]["losses"] == s["full"]["losses"] for s in per_seed)
    print(f"{args.seeds} seeds, {args.steps} steps, failure after step {args.fail_at}, "
          f"saves every {args.every} steps")
    print(f"{'run':<14}{'train loss':>18}{'held-out loss':>20}{'bytes vs full':>15}")
    for k, t in table.items():
        b = f"{t['bytes_vs_full']:.2f}" if t["bytes_vs_full"] is not None else "-"
        print(f"{k:<14}{t['train_loss']:>10.4f} ± {t['train_spread']:.4f}"
              f"{t['heldout_loss']:>12.4f} ± {t['heldout_spread']:.4f}{b:>15}")
    print(f"identity resume equals full resume, loss for loss: {identical}")
    (OUT / "quality.json").write_text(json.dumps({"args": vars(args), "table": table,
                                                  "identity_equals_full": identical,
                                                  "runs": per_seed}, indent=2))
    plot(per_seed, args, OUT / "quality.png")
    print(f"wrote {OUT / 'quality.json'} and {OUT / 'quality.png'}")


def _spread(xs: list[float]) -> float:
    return statistics.pstdev(xs) if len(xs) > 1 else 0.0


def plot(per_seed, args, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for k in per_seed[0]:
        curves = [s[k]["losses"] for s in per_seed]
        n = min(len(c) for c in curves)
        mean = [statistics.mean(c[i] for c in curves) for i in range(n)]
        first = args.steps - n + 1
        ax.plot(range(first, first + n), mean, label=k, lw=1)
    ax.axvline(args.fail_at, color="gray", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.set_ylabel("train loss (mean over seeds, log scale)")
    ax.set_title("resumed after a failure: full vs composite checkpoints")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
