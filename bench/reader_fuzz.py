"""The reader fuzzer's long run (issue 40, part 3a): mpitailor's torch-free reader against
torch.load(weights_only=True), input by input (tests/reader_fuzzing.py, reader_oracle.py).

    python -m bench.reader_fuzz [--count 1000000] [--seed 1] [--jobs 2] [--start 0]
        [--shrink 400] [--json bench/out/reader_fuzz.json]
        [--findings bench/out/reader_fuzz_findings]
    python -m bench.reader_fuzz --seed S --only INDEX   (replay one input, and keep it)

Input number i of seed S is always the same bytes, so --jobs processes share the numbers
(each takes every jobs-th chunk). Per input: the verdict (agree-accept, agree-refuse,
stricter, stand-in, or a finding), the time of both loads and the checks, and the growth of
the process's peak RSS (ru_maxrss; so only new peaks count). An input slower than
reader_oracle.SLOW_S or growing the peak by more than MEMORY_MB is a finding too. For each
kind of finding the smallest input is shrunk (records dropped, then the pickle cut by ddmin,
--shrink loads at most) and saved in --findings as NN-verdict.pt with NN-verdict.txt, one
line saying what it is; index.txt lists them all. Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import reader_fuzzing as fz  # noqa: E402 - tests/ is put on the path just above
import reader_oracle as oracle  # noqa: E402

CHUNK = 500
_worker: dict = {}


def _tmp_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _seeds() -> list:
    from ckpt_fixtures import build  # real DeepSpeed runs, built once and cached
    return fz.load_seeds(fz.seed_files([Path(build(n)) for n in fz.SEED_FIXTURES]))


def _init(seed_files: list[str], run: str) -> None:
    import faulthandler

    import torch
    faulthandler.enable()  # a segfault says where on stderr
    torch.set_num_threads(1)
    _worker["run"] = run
    _worker["seeds"] = fz.load_seeds([Path(f) for f in seed_files])
    _worker["path"] = Path(_tmp_dir()) / f"mpitailor-reader-fuzz-{os.getpid()}.pt"
    from multiprocessing.util import Finalize
    Finalize(None, _worker["path"].unlink, kwargs={"missing_ok": True}, exitpriority=1)
    fz.plant_marker()
    oracle.limit_memory()
    for allow in (fz.DEEPSPEED, fz.NUMPY):  # imports deepspeed and numpy once, not in an input
        oracle.torch_side(b"", allow)


def _tally() -> dict:
    return {"inputs": collections.Counter(), "verdicts": collections.Counter(),
            "stricter": collections.Counter(), "findings": {}, "worst_s": (0.0, -1),
            "worst_rss_mb": (0.0, -1), "seconds": 0.0,
            "kind_s": collections.Counter()}


def _verdict(o: oracle.Outcome) -> tuple[str, str]:
    if oracle.finding(o):
        return o.verdict, o.sig
    if o.seconds > oracle.SLOW_S:
        return "slow", f"one input took over {oracle.SLOW_S} s ({o.verdict})"
    if o.rss_mb > oracle.MEMORY_MB:
        return "memory", f"one input grew the peak RSS by over {oracle.MEMORY_MB} MB"
    return o.verdict, o.sig


def _progress(run: str, first: int) -> Path:
    return Path(_tmp_dir()) / f"mpitailor-reader-fuzz-{run}-{first}.at"


def _run(job: tuple[int, range, frozenset]) -> dict:
    seed, indices, skip = job
    t = _tally()
    start = time.perf_counter()
    at = _progress(_worker["run"], indices.start)
    for i in indices:
        if i in skip:
            continue
        at.write_text(str(i))  # where a process that dies was: see fuzz()
        try:
            inp = fz.make_input(seed, i, _worker["seeds"])
        except Exception as e:  # noqa: BLE001 - a bug of the generator: reported, not fatal
            inp = fz.Input("generator", b"", f"{type(e).__name__}: {e}")
            o = oracle.Outcome("harness", f"the generator raised {type(e).__name__}")
        else:
            o = oracle.judge(inp, _worker["path"])
        verdict, sig = _verdict(o)
        t["inputs"][inp.kind] += 1
        t["kind_s"][inp.kind] += o.seconds
        t["verdicts"][f"{inp.kind} {verdict}"] += 1
        if verdict == "stricter":
            t["stricter"][sig] += 1
        elif verdict in oracle.FINDINGS:
            key = f"{verdict}\t{sig}"
            n, best = t["findings"].get(key, (0, None))
            if best is None or len(inp.data) < best[0]:
                best = (len(inp.data), i, inp.kind, inp.note[:200], o.detail[:200])
            t["findings"][key] = (n + 1, best)
        t["worst_s"] = max(t["worst_s"], (o.seconds, i))
        t["worst_rss_mb"] = max(t["worst_rss_mb"], (o.rss_mb, i))
    t["seconds"] = time.perf_counter() - start
    at.unlink(missing_ok=True)
    return t


def _merge(total: dict, t: dict) -> None:
    for k in ("inputs", "verdicts", "stricter", "kind_s"):
        total[k].update(t[k])
    for key, (n, best) in t["findings"].items():
        m, old = total["findings"].get(key, (0, None))
        total["findings"][key] = (m + n, best if old is None or best[0] < old[0] else old)
    for k in ("worst_s", "worst_rss_mb"):
        total[k] = max(total[k], t[k])
    total["seconds"] += t["seconds"]


def fuzz(seed: int, start: int, count: int, jobs: int, seeds: list) -> dict:
    """Every input on `jobs` processes. A process that dies (a segfault: so far torch and
    numpy on a crafted numpy state, never mpitailor) or is stuck (see _completed) takes its
    chunk's tally with it: the chunk runs again, and an input at which the same chunk dies
    twice is counted as a `process-crash` and skipped."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    files = sorted({str(f) for f in fz.seed_files([Path(_build(n)) for n in fz.SEED_FIXTURES])})
    run = f"{os.getpid()}-{time.time_ns()}"
    todo = {a: (seed, range(a, min(a + CHUNK, start + count)), frozenset())
            for a in range(start, start + count, CHUNK)}
    total, done, t0, last = _tally(), 0, time.time(), 0.0
    total["crashes"], died_at = [], {}
    while todo:
        ctx = multiprocessing.get_context("forkserver")
        try:
            with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init,
                                     initargs=(files, run)) as ex:
                futures = {ex.submit(_run, job): a for a, job in todo.items()}
                for f in _completed(futures, ex, run):
                    t = f.result()
                    del todo[futures[f]]
                    _merge(total, t)
                    done += sum(t["inputs"].values())
                    if time.time() - last > 30:
                        last = time.time()
                        found = sum(n for n, _ in total["findings"].values())
                        print(f"  {done:,} of {count:,} inputs, {done / (last - t0):.0f}/s, "
                              f"{found} findings", file=sys.stderr, flush=True)
        except BrokenProcessPool:
            for a, (sd, rng, skip) in list(todo.items()):
                p = _progress(run, a)
                if not p.exists():
                    continue
                i = int(p.read_text())
                p.unlink()
                if died_at.get(a) == i:  # the same input twice: it is the one
                    total["crashes"].append(i)
                    todo[a] = (sd, rng, skip | {i})
                died_at[a] = i
            print(f"  a process died; {len(todo)} chunks run again "
                  f"(crashing inputs so far: {total['crashes']})", file=sys.stderr, flush=True)
    total["wall_s"] = time.time() - t0
    return total


STUCK_S = 3 * oracle.HANG_S  # an input this long: the process is stuck in C code


def _completed(futures: dict, ex, run: str):
    """as_completed, and a watchdog: an input that runs past STUCK_S (torch hashing a key
    shared 2^64 times never comes back to Python, where the alarm would stop it) ends the
    pool's processes, which fuzz() then handles as a process that died."""
    from concurrent.futures import FIRST_COMPLETED, wait
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=10, return_when=FIRST_COMPLETED)
        yield from done
        now = time.time()
        stale = [p for p in Path(_tmp_dir()).glob(f"mpitailor-reader-fuzz-{run}-*.at")
                 if now - p.stat().st_mtime > STUCK_S]
        if stale:
            for proc in list(ex._processes.values()):  # noqa: SLF001 - no public way
                proc.kill()


def _build(name: str) -> str:
    from ckpt_fixtures import build
    return build(name)


def _shrunk(job: tuple) -> bytes:
    """In a process of its own (a variant may crash torch's side): the input, shrunk."""
    seed, index, verdict, sig, budget = job
    inp = fz.make_input(seed, index, _worker["seeds"])
    want = oracle.judge(inp, _worker["path"])
    if (want.verdict, want.sig) != (verdict, sig) or verdict in ("slow", "memory", "hang"):
        return inp.data
    return oracle.shrink(inp, want, _worker["path"], budget).data


def save_findings(total: dict, seed: int, seeds: list, out: Path, budget: int) -> list[dict]:
    """Shrink the smallest input of each kind of finding and write it to `out`; inputs at
    which a process died are kept as they are."""
    from concurrent.futures import ProcessPoolExecutor
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        if old.suffix in (".pt", ".txt"):
            old.unlink()
    kinds = sorted(total["findings"].items(), key=lambda kv: -kv[1][0])
    kinds += [(f"process-crash\ta fuzzing process died (a segfault) or hung at this input",
               (1, (0, i, "", "", ""))) for i in total.get("crashes", [])]
    files = sorted({str(f) for f in fz.seed_files([Path(_build(n)) for n in fz.SEED_FIXTURES])})
    saved, pool = [], [None]

    def shrunk(job: tuple) -> bytes | None:
        """One process shrinks them all; one that dies (a variant crashed torch's side) is
        replaced, and that input is kept whole."""
        if pool[0] is None:
            pool[0] = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(
                "forkserver"), initializer=_init, initargs=(files, "shrink"))
        try:
            return pool[0].submit(_shrunk, job).result()
        except Exception:  # noqa: BLE001 - BrokenProcessPool, or the harness's own error
            pool[0].shutdown(cancel_futures=True)
            pool[0] = None
            return None
    for n, (key, (count, (size, index, kind, note, detail))) in enumerate(kinds):
        verdict, sig = key.split("\t", 1)
        try:
            inp = fz.make_input(seed, index, seeds)
        except Exception:  # noqa: BLE001 - the generator's own bug: its line says so
            inp = fz.Input("generator", b"", note)
        small = inp.data
        if inp.data and verdict != "process-crash":
            small = shrunk((seed, index, verdict, sig, budget)) or inp.data
        name = f"{n:02d}-{verdict}"
        (out / f"{name}.pt").write_bytes(small)
        line = (f"{verdict}: {sig} | {count} inputs | seed {seed} index {index} "
                f"({inp.kind}: {inp.note[:200]}) | {len(small)} bytes, shrunk from "
                f"{len(inp.data)}")
        (out / f"{name}.txt").write_text(line + "\n")
        saved.append({"file": f"{name}.pt", "verdict": verdict, "kind": sig, "count": count,
                      "seed": seed, "index": index, "input_kind": inp.kind,
                      "note": inp.note[:200], "detail": detail, "bytes": len(small),
                      "bytes_before": len(inp.data)})
    if pool[0] is not None:
        pool[0].shutdown()
    (out / "index.txt").write_text("".join(
        f"{s['file']}: {s['verdict']}: {s['kind']} ({s['count']} inputs)\n" for s in saved))
    return saved


def table(total: dict, saved: list[dict], count: int, jobs: int) -> str:
    lines = ["inputs tried, by kind and verdict:",
             f"  {'kind':16s} {'inputs':>9s} {'agree':>9s} {'stricter':>9s} {'stand-in':>9s} "
             f"{'torch-hang':>10s} {'findings':>9s} {'ours ms':>9s}"]
    for kind in fz.KINDS:
        v = {x.split(" ", 1)[1]: n for x, n in total["verdicts"].items() if x.startswith(kind)}
        agree = v.get("agree-accept", 0) + v.get("agree-refuse", 0)
        found = sum(n for x, n in v.items() if x in oracle.FINDINGS)
        lines.append(f"  {kind:16s} {total['inputs'][kind]:9,} {agree:9,} "
                     f"{v.get('stricter', 0):9,} {v.get('stand-in', 0):9,} "
                     f"{v.get('torch-hang', 0):10,} {found:9,} "
                     f"{total['kind_s'][kind] / max(total['inputs'][kind], 1) * 1e3:9.2f}")
    lines.append("stricter refusals (mpitailor refuses, torch reads), by kind:")
    lines += [f"  {n:8,}  {sig}" for sig, n in total["stricter"].most_common(25)]
    if len(total["stricter"]) > 25:
        lines.append(f"  ... {len(total['stricter']) - 25} more kinds in the JSON")
    lines.append(f"findings (disagreements): {sum(s['count'] for s in saved):,} inputs, "
                 f"{len(saved)} kinds")
    lines += [f"  {s['count']:8,}  {s['file']}: {s['kind']}" for s in saved]
    (ws, wi), (wr, ri) = total["worst_s"], total["worst_rss_mb"]
    lines.append(f"worst time {ws:.3f} s (index {wi}); worst peak-RSS growth {wr:.1f} MB "
                 f"(index {ri}); {total['wall_s']:.0f} s wall for {count:,} inputs on {jobs} "
                 f"processes ({total['seconds'] / max(count, 1) * 1e3:.2f} ms an input)")
    return "\n".join(lines)


def replay(seed: int, index: int, seeds: list, out: Path) -> None:
    fz.plant_marker()
    oracle.limit_memory()
    inp = fz.make_input(seed, index, seeds)
    scratch = Path(_tmp_dir()) / f"mpitailor-reader-replay-{os.getpid()}.pt"
    o = oracle.judge(inp, scratch)
    scratch.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    keep = out / f"replay-{seed}-{index}.pt"
    keep.write_bytes(inp.data)
    print(f"{inp.kind}: {inp.note}\n{o.verdict}: {o.sig}\n{o.detail}\n"
          f"{o.seconds:.3f} s; input kept in {keep}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first input number")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--shrink", type=int, default=400, help="loads per reproducer, at most")
    ap.add_argument("--only", type=int, help="replay this one input number")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "out" / "reader_fuzz.json")
    ap.add_argument("--findings", type=Path,
                    default=REPO / "bench" / "out" / "reader_fuzz_findings")
    a = ap.parse_args(argv)
    seeds = _seeds()
    if a.only is not None:
        replay(a.seed, a.only, seeds, a.findings)
        return 0
    total = fuzz(a.seed, a.start, a.count, a.jobs, seeds)
    saved = save_findings(total, a.seed, seeds, a.findings, a.shrink)
    print(table(total, saved, a.count, a.jobs))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit, "seed": a.seed,
        "start": a.start, "count": a.count, "jobs": a.jobs, "wall_s": total["wall_s"],
        "ms_per_input": total["seconds"] / max(a.count, 1) * 1e3,
        "inputs": dict(total["inputs"]), "verdicts": dict(total["verdicts"]),
        "stricter": dict(total["stricter"].most_common()), "findings": saved,
        "worst_s": total["worst_s"], "worst_rss_mb": total["worst_rss_mb"],
        "seeds": [s.label for s in seeds]}, indent=1))
    print(f"JSON: {a.json}; reproducers: {a.findings}")
    return 1 if saved else 0


if __name__ == "__main__":
    sys.exit(main())
