"""`export --format hf` of a DCP checkpoint against torch's own paths, side by side (issue 43).

    python -m bench.dcp_export_bench [--hidden 1024] [--layers 16] [--reps 2] [--dtype fp32]
        [--json bench/results/dcp_export_bench.json]

Input: step-2 of the DCP pair dcp_merge_bench builds (a real FSDP2 run, 2 ranks: ~2.9 GB of
model and Adam state; built once into bench/out/dcp_pair_h*_l*). Each case is a whole
process (interpreter, imports, reading, writing, the output fsynced), interleaved `--reps`
times:
- `torch dcp_to_torch_save`: torch's documented converter (`format_utils.dcp_to_torch_save`,
  every entry into one .pt), `torch.load` of it, the `model` entries (prefix dropped, cast
  for --dtype) written by safetensors' `save_file`, fsynced;
- `torch load model only`: the fastest torch path we know: `_load_state_dict` with
  `_EmptyStateDictLoadPlanner(keys={"model"})` (what dcp_to_torch_save runs, without the
  optimizer or the .pt), then `save_file`, fsynced;
- `mpitailor 1 rank` / `mpitailor 2 ranks`: `python -m mpitailor export DIR -o OUT --format
  hf --config CFG` (under `mpiexec -n 2`), published with a manifest.
(`consolidate_safetensors_files_on_every_rank` reads DCP checkpoints saved as safetensors
by HuggingFaceStorageWriter; FSDP2's `dcp.save` writes torch.save items, so it does not
apply here.) Prints median seconds and the median ratio to each torch path in the same
repetition; writes JSON with every row. One check per run: every case's tensors equal.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"
PY = REPO / ".venv" / "bin" / "python"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_export(src: str, out: str, how: str, dtype: str) -> None:
    """One torch case, in this process (run by main as a child)."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import (
        _EmptyStateDictLoadPlanner,
        _load_state_dict,
        dcp_to_torch_save,
    )
    os.makedirs(out)
    if how == "convert":
        pt = os.path.join(out, "all.pt")
        dcp_to_torch_save(src, pt)
        model = torch.load(pt, weights_only=False)["model"]
        os.remove(pt)
    else:
        sd: dict = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(src),
                         planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
        model = sd["model"]
    model = {k: v.to(getattr(torch, DTYPES[dtype])).contiguous() for k, v in model.items()}
    path = os.path.join(out, "model.safetensors")
    save_file(model, path, metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def make_config(run: Path, hidden: int, layers: int) -> Path:
    """The bench model's config.json (the spec dcp_merge_bench trains it with)."""
    from dev.tinytrain import TrainSpec
    from dev.tinytrain.model import tiny_config
    cfg = OUT / f"dcp_export_bench_config_h{hidden}_l{layers}"
    if not (cfg / "config.json").exists():
        tiny_config(TrainSpec(save_dir=str(run), world_size=2, layers=layers, hidden=hidden,
                              intermediate=int(hidden * 2.75), heads=16, kv_heads=4,
                              vocab=32000)).save_pretrained(cfg)
    return cfg


def same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--json", type=Path, default=OUT / "dcp_export_bench.json")
    ap.add_argument("--torch-case", nargs=3, help=argparse.SUPPRESS)  # SRC OUT HOW (child)
    args = ap.parse_args()
    if args.torch_case:
        torch_export(*args.torch_case, args.dtype)
        return 0
    from bench.dcp_merge_bench import build_pair
    run = build_pair(args.hidden, args.layers)
    src = run / "step-2"
    cfg = make_config(run, args.hidden, args.layers)
    size = sum(p.stat().st_size for p in src.iterdir())
    me = [str(PY), "-m", "bench.dcp_export_bench", "--dtype", args.dtype, "--torch-case"]
    ours = ["-m", "mpitailor", "export", str(src), "--config", str(cfg), "--dtype",
            args.dtype, "-q", "-o"]
    mpiexec = [str(PY.parent / "mpiexec"), "-n", "2", str(PY)]
    cases = {
        "torch dcp_to_torch_save": lambda o: timed([*me, str(src), str(o), "convert"]),
        "torch load model only": lambda o: timed([*me, str(src), str(o), "model"]),
        "mpitailor 1 rank": lambda o: timed([str(PY), *ours, str(o)]),
        "mpitailor 2 ranks": lambda o: timed([*mpiexec, *ours, str(o)]),
    }
    rows, outs = [], {c: OUT / f"dcp_export_bench_{i}" for i, c in enumerate(cases)}
    for rep in range(args.reps):
        for case, go in cases.items():
            shutil.rmtree(outs[case], ignore_errors=True)
            subprocess.run(["sync"], check=True)
            rows.append({"rep": rep, "case": case, "seconds": go(outs[case])})
            print(json.dumps(rows[-1]), flush=True)
    equal = all(same_tensors(outs["torch load model only"], o) for o in outs.values())
    written = (outs["mpitailor 1 rank"] / "model.safetensors").stat().st_size
    for o in outs.values():
        shutil.rmtree(o, ignore_errors=True)
    summary = _summary(rows, cases)
    print(f"DCP checkpoint of {size / 1e9:.2f} GB (FSDP2, 2 ranks) -> HF {args.dtype}, "
          f"{written / 1e9:.2f} GB; {args.reps} reps, {os.cpu_count()} cores; outputs equal: "
          f"{equal}")
    print(f"{'case':<26}{'seconds':>9}{'vs convert':>12}{'vs model-only':>15}")
    for case, s in summary.items():
        print(f"{case:<26}{s['seconds']:>9.2f}{s['vs_convert']:>11.2f}x"
              f"{s['vs_model_only']:>14.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"bytes_in": size, "bytes_out": written,
                                     "dtype": args.dtype, "equal": equal, "summary": summary,
                                     "rows": rows, "date": time.strftime("%Y-%m-%d")},
                                    indent=2))
    print(f"wrote {args.json}")
    return 0 if equal else 1


def _summary(rows: list[dict], cases) -> dict:
    """Per case: median seconds, and the median of its ratios to each torch case in the
    same repetition (below 1: mpitailor faster)."""
    def ratios(case: str, ref: str) -> float:
        return statistics.median(r["seconds"] / c["seconds"] for r in rows if r["case"] == case
                                 for c in rows if c["case"] == ref and c["rep"] == r["rep"])
    return {case: {"seconds": statistics.median(r["seconds"] for r in rows
                                                if r["case"] == case),
                   "vs_convert": ratios(case, "torch dcp_to_torch_save"),
                   "vs_model_only": ratios(case, "torch load model only")} for case in cases}


if __name__ == "__main__":
    sys.exit(main())
