"""Which `*ForCausalLM` architectures of the installed transformers mpitailor's built-in layer
rules understand, without `layer_patterns`.

    python -m bench.arch_sweep [--timeout 60]

Every model type of transformers' causal-LM auto mapping is built tiny from its config (3
layers, hidden 64, random init; `dev.tinytrain.model.tiny_config`), each in a process
of its own with a time limit (a config that ignores the tiny sizes can allocate for minutes). An architecture passes when every trainable parameter gets a layer
key other than `other`, the layers found are numbered 0..K-1 with none missing (per-layer
parameter counts may differ: hybrid and MoE models mix block kinds), and the embeddings are
found. One that cannot be built tiny this way (it needs a sub-config, a
vision tower, a download) is reported as such, not as a failure of the rules. Prints a table
and writes bench/out/arch_sweep.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
LAYERS = 3


def check(arch: str) -> dict:
    """Build `arch` tiny and classify its parameters (in a child process)."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from mpitailor.planning.layers import classify, layer_index
    from dev.tinytrain.model import build_model
    from dev.tinytrain.spec import TrainSpec

    try:
        model = build_model(TrainSpec(save_dir="unused", arch=arch, layers=LAYERS))
    except Exception as e:  # noqa: BLE001 - any reason it cannot be built tiny
        return {"arch": arch, "result": "not built", "why": f"{type(e).__name__}: {e}"[:200]}
    keys = Counter(classify(n) for n, p in model.named_parameters() if p.requires_grad)
    idx = sorted(i for k in keys if (i := layer_index(k)) is not None)
    problems = []
    if keys.get("other"):
        others = [n for n, _ in model.named_parameters() if classify(n) == "other"]
        problems.append(f"{keys['other']} parameter(s) under 'other', e.g. {others[0]}")
    # Some configs ignore the tiny layer count (decoder_layers, n_layer, ...): any number of
    # layers counts, as long as they are numbered 0..K-1 with none missing.
    if not idx or idx != list(range(len(idx))):
        problems.append(f"layer numbers found: {idx[:12]}")
    if "embed" not in keys:
        problems.append("no embeddings found")
    return {"arch": arch, "result": "fail" if problems else "pass", "why": "; ".join(problems),
            "keys": dict(sorted(keys.items()))}


def run_one(arch: str, timeout: float) -> dict:
    code = "import json, sys; from bench.arch_sweep import check; print(json.dumps(check(sys.argv[1])))"
    try:
        r = subprocess.run([sys.executable, "-c", code, arch], capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"arch": arch, "result": "not built", "why": f"over {timeout:.0f} s"}
    if r.returncode != 0:
        return {"arch": arch, "result": "not built", "why": r.stderr.strip()[-200:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per architecture")
    ap.add_argument("--only", nargs="*", help="these model types only")
    args = ap.parse_args()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    archs = args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        rows = list(pool.map(lambda a: run_one(a, args.timeout), archs))
    for row in rows:
        print(f"{row['arch']:<28}{row['result']:<10}{row.get('why', '')[:90]}")
    counts = Counter(r["result"] for r in rows)
    built = counts["pass"] + counts["fail"]
    summary = {"transformers_causal_lm_types": len(rows), "built_tiny": built,
               "pass": counts["pass"], "fail": counts["fail"], "not_built": counts["not built"]}
    print(f"\n{counts['pass']} of {built} architectures that build tiny pass "
          f"({len(rows)} causal-LM model types; {counts['not built']} not built tiny)")
    OUT.mkdir(exist_ok=True)
    (OUT / "arch_sweep.json").write_text(json.dumps({"summary": summary, "rows": rows},
                                                    indent=2))


if __name__ == "__main__":
    main()
