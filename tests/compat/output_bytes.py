"""Output bytes of a checkout, recorded and compared: proof that a rewrite changed no byte.

    python tests/compat/output_bytes.py run --checkout DIR --out OUTDIR [--jobs 2]
    python tests/compat/output_bytes.py compare A B
    python tests/compat/output_bytes.py list

`run` runs a fixed list of CLI commands (`python -m mpitailor ...`, a few under
`mpiexec -n 2`) with DIR's code (PYTHONPATH=DIR, the project's .venv python, the case's own
empty dir as cwd) against the fixtures in .cache/fixtures (MPITAILOR_FIXTURES overrides) and
against hostile copies of them that it builds itself (a non-checkpoint dir, forged pickles
that call os.system, a truncated optimizer file, client state of a class nobody can import).
Per case, OUTDIR/<case>/result.json records the command, its exit code, the sha256 of every
file left in the case's dir (output, staging leftovers, locks: relative path -> hash) and its
stdout/stderr text; OUTDIR/<case>/tree/ keeps the files themselves. OUTDIR/run.json records
the checkout's commit, the python, and a digest of every input (fixture dirs, hostile copies),
so that `compare` can tell a changed input from a changed output.

The commands write their outputs under one fixed work dir (--work, default
/tmp/mpitailor-output-bytes.work, emptied first, flock'ed: one run at a time), then the case
dirs move to OUTDIR. A fixed dir because a merge's manifest records its output path (the
recipe's `output:`): two runs can only give the same bytes if they write to the same path.
`compare` refuses two OUTDIRs made with different work dirs.

Normalised (everything else is compared byte for byte / character for character):
  - files named mpitailor_manifest.json: the value of the top-level `"created"` line (the
    wall-clock time of the merge/export, to the second) is blanked before hashing; nothing
    else in them is touched. Two runs of the same checkout differ in nothing else (checked).
  - stdout/stderr: the work dir, OUTDIR and the checkout dir become <WORK>, <OUTDIR>,
    <CHECKOUT>; the timings of the summary lines (`in 0.08 s`, `(0.03 GB/s)`) become
    `in <S> s`, `(<R> GB/s)`; progress lines (`copied ... ETA`) are dropped (the commands
    run with --no-progress where they take it).
  - under mpiexec the ranks' stderr lines interleave as they please: for those cases stderr
    is recorded as its lines sorted.
`seconds` and `cpu_seconds` (each case's wall and CPU time) are recorded, never compared.

`compare A B` prints every difference (case missing, exit code, file missing, hash, stdout,
stderr, input digest, payload ran) and exits 1 if there is any, 0 if none.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# tests/child_env.py is standard library only: this process never imports mpitailor (the
# checkout's runs in the commands, under PYTHONPATH=checkout)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from child_env import child_env  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("MPITAILOR_FIXTURES", REPO / ".cache" / "fixtures"))
VENV = REPO / ".venv" / "bin"
DEFAULT_WORK = Path("/tmp/mpitailor-output-bytes.work")
TIMEOUT = 300
MANIFEST = "mpitailor_manifest.json"
CREATED = re.compile(rb'^(  "created": )"[^"\n]*"(,?)$', re.M)

# fixture groups (by name without the hash)
TWO_FULL = ["w2_fp32_one", "w3_bf16_decay_tied_frozen", "w4_fp32_per_layer",
            "w2_bf16_small_subgroups_tied_frozen", "w3_qwen2_fp32_decay", "w2_bf16_per_layer",
            "hf_w2_fp32", "hf_w2_bf16", "hf_w3_bf16_weights_tied", "s2_w2_bf16_per_layer",
            "s2_w3_fp32_decay_tied_frozen", "s1_w2_fp32_one", "hf_s2_w2_bf16", "w2_fp32_wide"]
TIMELINE = ["w2_parity", "w2_adaptive", "w2_client_state", "hf_w2_parity",
            "s2_w3_bf16_parity", "hf_s2_w2_parity", "s1_w2_parity", "w2_parity_async",
            "s2_w3_bf16_parity_async", "s1_w2_parity_async", "hf_s2_w2_parity_async"]
ALL_FULL_TIMELINE = ["w2_parity_twin_full", "s2_w3_bf16_parity_twin_full"]
ZERO3 = ["w2_fp32_one", "w3_bf16_decay_tied_frozen", "w4_fp32_per_layer",
         "w2_bf16_small_subgroups_tied_frozen", "w3_qwen2_fp32_decay", "w2_bf16_per_layer",
         "hf_w2_fp32", "hf_w2_bf16", "hf_w3_bf16_weights_tied", "w2_fp32_wide"]
PARITY_POLICY = ["w2_parity", "w2_client_state", "hf_w2_parity", "s2_w3_bf16_parity",
                 "hf_s2_w2_parity", "s1_w2_parity", "w2_parity_async",
                 "s2_w3_bf16_parity_async", "s1_w2_parity_async", "hf_s2_w2_parity_async"]


# ---------------------------------------------------------------- inputs

def find_fixtures() -> dict[str, Path]:
    """The ZeRO fixtures (those with tag dirs; the DCP family's have step-N/)."""
    found = {}
    for d in sorted(FIXTURES.iterdir()):
        if d.is_dir() and (d / "DONE").exists() and re.fullmatch(r".+-[0-9a-f]{12}", d.name) \
                and tags(d):
            found[d.name.rsplit("-", 1)[0]] = d
    return found


def tags(save: Path) -> list[Path]:
    """The save's tag dirs (global_stepN/ or HF checkpoint-N/), oldest first."""
    got = [p for p in save.iterdir() if p.is_dir()
           and re.fullmatch(r"(global_step|checkpoint-)\d+", p.name)]
    return sorted(got, key=lambda p: int(re.search(r"\d+$", p.name)[0]))


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            h.update(f"L {rel} {os.readlink(p)}\n".encode())
        elif p.is_file():
            h.update(f"F {rel} {file_hash(p)}\n".encode())
        elif p.is_dir():
            h.update(f"D {rel}\n".encode())
    return h.hexdigest()


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def output_hash(path: Path) -> str:
    """sha256 of an output file; a manifest's `created` time blanked first."""
    if path.name != MANIFEST:
        return file_hash(path)
    data = CREATED.sub(rb'\1"<CREATED>"\2', path.read_bytes(), count=1)
    return hashlib.sha256(data).hexdigest()


class _Payload:
    """Pickles as a call to os.system (GLOBAL posix.system + REDUCE), as a hostile
    checkpoint would; the command touches `marker`, so a run payload shows."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Tripwire:
    """Client state of a class no one can import (module mpitailor_bytes_probe): merged as
    a stand-in, written back with the same global and state."""

    def __init__(self, note: str):
        self.note = note


def _register_tripwire():
    import types
    mod = types.ModuleType("mpitailor_bytes_probe")
    Tripwire.__module__ = "mpitailor_bytes_probe"
    Tripwire.__qualname__ = "Tripwire"
    mod.Tripwire = Tripwire
    sys.modules["mpitailor_bytes_probe"] = mod


def build_hostile(fx: dict[str, Path], inputs: Path) -> dict[str, Path]:
    """Hostile copies of fixtures, built with torch from the (trusted) fixture files."""
    import torch
    _register_tripwire()
    marker = str(inputs / "PAYLOAD_RAN")
    out = {}

    def copy(name: str, as_name: str) -> Path:
        dst = inputs / as_name
        shutil.copytree(fx[name], dst, symlinks=True)
        return dst

    def rewrite(path: Path, key: str, value) -> None:
        obj = torch.load(path, map_location="cpu", weights_only=False)
        obj[key] = value
        torch.save(obj, path)

    d = inputs / "not_a_checkpoint"
    d.mkdir()
    (d / "notes.txt").write_text("not a checkpoint\n")
    (d / "global_step1").mkdir()
    (d / "global_step1" / "readme.md").write_text("nothing here\n")
    out["not_a_checkpoint"] = d

    root = copy("w2_fp32_one", "forged_model_z3")
    rewrite(root / "global_step5" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
            "innocent_looking_key", _Payload(marker))
    out["forged_model_z3"] = root

    root = copy("w2_fp32_one", "forged_optim_z3")
    rewrite(root / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "innocent_looking_key", _Payload(marker))
    out["forged_optim_z3"] = root

    root = copy("s1_w2_fp32_one", "forged_model_s1")
    rewrite(root / "global_step5" / "mp_rank_00_model_states.pt", "innocent_looking_key",
            _Payload(marker))
    out["forged_model_s1"] = root

    root = copy("w2_fp32_one", "truncated_optim")
    victim = root / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    out["truncated_optim"] = root

    root = copy("w2_fp32_one", "tripwire_client_state")
    for step in (5, 10):
        for rank in (0, 1):
            rewrite(root / f"global_step{step}" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                    "tripwire", Tripwire(f"step {step} rank {rank}"))
    out["tripwire_client_state"] = root

    out["prune_w2_parity"] = copy("w2_parity", "prune_w2_parity")
    out["prune_dry_w2_parity"] = copy("w2_parity", "prune_dry_w2_parity")
    return out


# ---------------------------------------------------------------- cases

@dataclass
class Case:
    name: str
    args: list[str]          # after `python -m mpitailor`; "{OUT}" -> the case's output path
    ranks: int = 1
    phase: int = 0           # phase 1 runs after phase 0 (uses its outputs)
    recipe: str | None = None  # text written to WORK/recipes/<name>.yml; "{RECIPE}" in args
    precreate_out: bool = False  # the output dir exists before the command runs
    target: Path | None = None   # a dir the command changes in place: its files recorded too


def parity_recipe(new: Path, old: Path, out: str = "{OUT}", **extra) -> str:
    lines = [f"sources:\n  new: {new}\n  old: {old}",
             "layers:\n  even: new\n  odd: old",
             "embed: new\nnorm: new\nlm_head: new\nbase: new\nadam_step: newest",
             f"output: {out}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def filter_recipe(new: Path, old: Path) -> str:
    return (f"sources:\n  new: {new}\n  old: {old}\nlayers:\n  \"0\": new\n  \"3\": new\n"
            f"  rest: old\nembed: new\nnorm: old\nlm_head: new\nadam_step: oldest\n"
            f"output: {{OUT}}\n")


def slices_recipe(new: Path, old: Path) -> str:
    return ("merge_method: passthrough\nslices:\n"
            f"  - sources:\n      - model: {old}\n        layer_range: [0, 2]\n"
            f"  - sources:\n      - model: {new}\n        layer_range: [2, 4]\n"
            f"embed: {old}\nnorm: {new}\nlm_head: {new}\nbase_model: {new}\noutput: {{OUT}}\n")


def build_cases(fx: dict[str, Path], hostile: dict[str, Path], work: Path) -> list[Case]:
    cases: list[Case] = []
    NP = ["--no-progress"]

    def add(name, args, **kw):
        cases.append(Case(name, [str(a) for a in args], **kw))

    def out_of(case: str) -> Path:
        return work / "cases" / case / "out"

    present = lambda names: [n for n in names if n in fx]  # noqa: E731

    # -- merges between two full saves of one run: parity (alternating) for every one
    for n in present(TWO_FULL):
        t = tags(fx[n])
        add(f"merge_parity__{n}", ["merge", "{RECIPE}", *NP], recipe=parity_recipe(t[-1], t[0]))
    for n in present(["w2_fp32_one", "s2_w3_fp32_decay_tied_frozen", "hf_w2_bf16"]):
        t = tags(fx[n])
        add(f"merge_filter__{n}", ["merge", "{RECIPE}", *NP], recipe=filter_recipe(t[-1], t[0]))
    for n in present(["w3_qwen2_fp32_decay", "s1_w2_fp32_one"]):
        t = tags(fx[n])
        add(f"merge_slices__{n}", ["{RECIPE}", *NP], recipe=slices_recipe(t[-1], t[0]))
    # identity merge (one source) and a merge whose base is the older save
    if "w2_bf16_per_layer" in fx:
        t = tags(fx["w2_bf16_per_layer"])
        add("merge_identity__w2_bf16_per_layer", ["merge", "{RECIPE}", *NP],
            recipe=parity_recipe(t[-1], t[-1]))
    # -- merges of a layer-wise run's tags (partial saves as sources): parity policy
    #    saves even layers at step 6 and odd ones (+ embed, norm, head) at step 8
    for n in present(PARITY_POLICY):
        t = tags(fx[n])
        add(f"merge_partials__{n}", ["merge", "{RECIPE}", *NP],
            recipe=parity_recipe(t[-1], t[-2]).replace("even: new\n  odd: old",
                                                       "even: old\n  odd: new"))
    for n in present(["w2_parity", "s1_w2_parity"]):
        t = tags(fx[n])  # the other way round: step 8 holds no even layer -> refused
        add(f"merge_partials_refused__{n}", ["merge", "{RECIPE}", *NP],
            recipe=parity_recipe(t[-1], t[-2]))
    for n in present(ALL_FULL_TIMELINE):
        t = tags(fx[n])
        add(f"merge_parity__{n}", ["merge", "{RECIPE}", *NP], recipe=parity_recipe(t[-1], t[0]))
    # -- reshard (--world-size) of merges
    for n, w in [("w2_fp32_one", 3), ("s2_w2_bf16_per_layer", 3), ("w4_fp32_per_layer", 2),
                 ("w3_qwen2_fp32_decay", 2), ("s2_w3_fp32_decay_tied_frozen", 2),
                 ("w2_bf16_small_subgroups_tied_frozen", 3)]:
        if n in fx:
            t = tags(fx[n])
            add(f"merge_ws{w}__{n}", ["merge", "{RECIPE}", "--world-size", w, *NP],
                recipe=parity_recipe(t[-1], t[0]))
    # -- merge --export variants
    exports = [("w2_fp32_one", ["--export", "safetensors", "--export", "universal"]),
               ("w3_bf16_decay_tied_frozen", ["--export", "universal", "--world-size", "2"]),
               ("hf_w3_bf16_weights_tied", ["--export", "safetensors", "--export-dtype", "fp16"]),
               ("s2_w3_fp32_decay_tied_frozen", ["--export", "safetensors", "--export-dtype",
                                                 "bf16", "--max-shard-size", "100KB"]),
               ("w2_bf16_small_subgroups_tied_frozen", ["--export", "universal"]),
               ("hf_w2_fp32", ["--export", "safetensors", "--export-dtype", "bf16"]),
               ("s1_w2_fp32_one", ["--export", "universal"])]  # refused: stage 1
    for n, extra in exports:
        if n in fx:
            t = tags(fx[n])
            add(f"merge_export__{n}", ["merge", "{RECIPE}", *extra, *NP],
                recipe=parity_recipe(t[-1], t[0]))
    # -- dry runs
    for n, extra in [("w2_fp32_one", []), ("s2_w3_fp32_decay_tied_frozen", ["--world-size", "2"]),
                     ("w3_bf16_decay_tied_frozen", ["--export", "universal"])]:
        if n in fx:
            t = tags(fx[n])
            add(f"merge_dryrun__{n}", ["merge", "{RECIPE}", "--dry-run", *extra],
                recipe=parity_recipe(t[-1], t[0]))

    # -- recover: every timeline of saves; a few runs of full saves only (their newest)
    for n in present(TIMELINE + ALL_FULL_TIMELINE + ["w2_fp32_one", "hf_w3_bf16_weights_tied",
                                                     "s2_w3_fp32_decay_tied_frozen",
                                                     "w1_step0"]):
        add(f"recover__{n}", ["recover", fx[n], "-o", "{OUT}", *NP])
    for n in present(["w2_parity", "s1_w2_parity", "hf_w2_parity", "w2_client_state",
                      "s2_w3_bf16_parity_twin_full"]):
        add(f"recover_ws3__{n}", ["recover", fx[n], "-o", "{OUT}", "--world-size", "3", *NP])
    for n in present(["w2_parity", "s2_w3_bf16_parity", "hf_s2_w2_parity", "w2_adaptive"]):
        add(f"recover_ws1__{n}", ["recover", fx[n], "-o", "{OUT}", "--world-size", "1", *NP])
    if "w2_parity" in fx:
        add("recover_export__w2_parity",
            ["recover", fx["w2_parity"], "-o", "{OUT}", "--export", "safetensors",
             "--export-dtype", "bf16", "--max-shard-size", "100KB", "--export", "universal",
             *NP])
        add("recover_dryrun__w2_parity", ["recover", fx["w2_parity"], "--dry-run"])
    if "w2_client_state" in fx:
        add("recover_safe_globals__w2_client_state",
            ["recover", fx["w2_client_state"], "-o", "{OUT}", "--safe-globals",
             "argparse.Namespace", *NP])
    if "w2_adaptive" in fx:
        add("recover_emit_recipe__w2_adaptive",
            ["recover", fx["w2_adaptive"], "-o", "{OUT}", "--emit-recipe"])

    # -- export
    for n in present(TWO_FULL + ALL_FULL_TIMELINE + ["w2_parity", "s1_w2_parity", "w1_step0"]):
        add(f"export_fp32__{n}", ["export", fx[n], "-o", "{OUT}", "--format", "fp32", *NP])
    for n in present(["hf_w2_fp32", "hf_w2_bf16", "hf_w3_bf16_weights_tied", "hf_s2_w2_bf16",
                      "hf_w2_parity", "hf_s2_w2_parity"]):
        add(f"export_hf__{n}", ["export", fx[n], "-o", "{OUT}", "--format", "hf", *NP])
    for n, dt in [("hf_w2_fp32", "bf16"), ("hf_w2_fp32", "fp16"), ("hf_w2_bf16", "fp16"),
                  ("hf_w2_bf16", "fp32"), ("hf_w3_bf16_weights_tied", "fp16"),
                  ("hf_s2_w2_bf16", "fp16"), ("hf_w2_parity", "bf16")]:
        if n in fx:
            add(f"export_hf_{dt}__{n}", ["export", fx[n], "-o", "{OUT}", "--format", "hf",
                                         "--dtype", dt, *NP])
    if "hf_w2_bf16" in fx:
        add("export_hf_shards__hf_w2_bf16",
            ["export", tags(fx["hf_w2_bf16"])[0], "-o", "{OUT}", "--max-shard-size", "50KB",
             *NP])
    # plain DeepSpeed saves: refused without --config, exported with an HF run's config
    for n, cfg in [("w2_parity", "hf_w2_parity"), ("w2_bf16_per_layer", "hf_w2_bf16"),
                   ("s2_w2_bf16_per_layer", "hf_s2_w2_bf16")]:
        if n in fx and cfg in fx:
            add(f"export_hf_config__{n}", ["export", fx[n], "-o", "{OUT}", "--config",
                                           tags(fx[cfg])[-1] / "config.json", *NP])
    if "w2_bf16_per_layer" in fx:
        add("export_hf_noconfig__w2_bf16_per_layer",
            ["export", fx["w2_bf16_per_layer"], "-o", "{OUT}", *NP])
    for n in present(ZERO3 + ["w2_parity", "w2_adaptive", "s2_w2_bf16_per_layer"]):
        add(f"export_universal__{n}", ["export", fx[n], "-o", "{OUT}", "--format", "universal",
                                       *NP])
    if "w2_fp32_one" in fx:
        add("export_verify_fp32__w2_fp32_one",
            ["export", tags(fx["w2_fp32_one"])[0], "-o", "{OUT}", "--format", "fp32",
             "--verify", *NP])

    # -- inspect --json: the newest tag of every fixture, a partial save of each timeline
    for n in fx:
        add(f"inspect__{n}", ["inspect", tags(fx[n])[-1], "--json"])
    for n in present(TIMELINE):
        add(f"inspect_partial__{n}", ["inspect", tags(fx[n])[1], "--json"])
    for n in present(["w3_bf16_decay_tied_frozen", "s2_w3_bf16_parity"]):
        add(f"inspect_text__{n}", ["inspect", fx[n]])

    # -- diff of two tags
    for n, js in [("w2_fp32_one", True), ("w2_fp32_one", False), ("s2_w2_bf16_per_layer", True),
                  ("hf_w3_bf16_weights_tied", True), ("w2_parity", True),
                  ("s2_w3_bf16_parity", True)]:
        if n in fx:
            t = tags(fx[n])
            add(f"diff{'_json' if js else '_text'}__{n}",
                ["diff", t[0], t[-1], *(["--json"] if js else [])])
    if "w2_parity" in fx and "w2_parity_twin_full" in fx:
        add("diff_twins__w2_parity", ["diff", tags(fx["w2_parity"])[-1],
                                      tags(fx["w2_parity_twin_full"])[-1], "--json"])

    # -- prune (on copies)
    if "prune_dry_w2_parity" in hostile:
        add("prune_dryrun__w2_parity", ["prune", hostile["prune_dry_w2_parity"], "--keep-last",
                                        "1", "--dry-run"], target=hostile["prune_dry_w2_parity"])
        add("prune__w2_parity", ["prune", hostile["prune_w2_parity"], "--keep-last", "1"],
            target=hostile["prune_w2_parity"])

    # -- hostile and damaged inputs: exit code and message
    bad = hostile["not_a_checkpoint"]
    add("refuse_notckpt_inspect", ["inspect", bad, "--json"])
    add("refuse_notckpt_export", ["export", bad, "-o", "{OUT}", "--format", "fp32", *NP])
    add("refuse_notckpt_recover", ["recover", bad, "-o", "{OUT}", *NP])
    add("refuse_notckpt_merge", ["merge", "{RECIPE}", *NP],
        recipe=parity_recipe(bad / "global_step1", bad / "global_step1"))
    f = hostile["forged_model_z3"]
    add("refuse_forged_model_inspect", ["inspect", f / "global_step5", "--json"])
    add("refuse_forged_model_merge", ["merge", "{RECIPE}", *NP],
        recipe=parity_recipe(f / "global_step10", f / "global_step5"))
    add("refuse_forged_model_export", ["export", f / "global_step5", "-o", "{OUT}", "--format",
                                       "fp32", *NP])
    add("forged_older_save_recover", ["recover", f, "-o", "{OUT}", *NP])
    f = hostile["forged_optim_z3"]
    add("refuse_forged_optim_merge", ["merge", "{RECIPE}", *NP],
        recipe=parity_recipe(f / "global_step10", f / "global_step5"))
    add("refuse_forged_optim_diff", ["diff", f / "global_step5", f / "global_step10"])
    f = hostile["forged_model_s1"]
    add("refuse_forged_s1_inspect", ["inspect", f / "global_step5"])
    add("refuse_forged_s1_export", ["export", f / "global_step5", "-o", "{OUT}", "--format",
                                    "fp32", *NP])
    add("refuse_forged_s1_merge", ["merge", "{RECIPE}", *NP],
        recipe=parity_recipe(f / "global_step10", f / "global_step5"))
    f = hostile["truncated_optim"]
    add("refuse_truncated_inspect", ["inspect", f / "global_step10", "--json"])
    add("refuse_truncated_merge", ["merge", "{RECIPE}", *NP],
        recipe=parity_recipe(f / "global_step10", f / "global_step5"))
    add("refuse_truncated_export", ["export", f / "global_step10", "-o", "{OUT}", "--format",
                                    "fp32", *NP])
    add("truncated_recover_skips", ["recover", f, "-o", "{OUT}", *NP])
    f = hostile["tripwire_client_state"]
    add("untrusted_client_state_merge", ["merge", "{RECIPE}", *NP],
        recipe=parity_recipe(f / "global_step10", f / "global_step5"))
    add("untrusted_client_state_refuse_safe_globals",
        ["merge", "{RECIPE}", "--safe-globals", "mpitailor_bytes_probe.Tripwire", *NP],
        recipe=parity_recipe(f / "global_step10", f / "global_step5"))
    if "w2_fp32_one" in fx:
        add("refuse_output_exists", ["export", fx["w2_fp32_one"], "-o", "{OUT}",
                                     "--format", "fp32", *NP], precreate_out=True)
        add("refuse_export_dtype_fp32", ["export", fx["w2_fp32_one"], "-o", "{OUT}",
                                         "--format", "fp32", "--dtype", "bf16", *NP])
    if "hf_w2_parity" in fx:
        add("refuse_export_partial_tag", ["export", tags(fx["hf_w2_parity"])[1], "-o", "{OUT}",
                                          *NP])

    # -- under mpiexec -n 2
    mpi = []
    if "w2_fp32_one" in fx:
        t = tags(fx["w2_fp32_one"])
        mpi.append(("mpi2_merge_parity__w2_fp32_one", ["merge", "{RECIPE}", *NP],
                    parity_recipe(t[-1], t[0])))
    if "w3_bf16_decay_tied_frozen" in fx:
        t = tags(fx["w3_bf16_decay_tied_frozen"])
        mpi.append(("mpi2_merge_ws2_export__w3_bf16_decay_tied_frozen",
                    ["merge", "{RECIPE}", "--world-size", "2", "--export", "universal",
                     "--export", "safetensors", *NP], parity_recipe(t[-1], t[0])))
    for n, extra in [("w2_parity", []), ("s2_w3_bf16_parity", ["--world-size", "3"]),
                     ("s1_w2_parity", ["--world-size", "1"]), ("hf_w2_parity", [])]:
        if n in fx:
            mpi.append((f"mpi2_recover__{n}" + (f"_ws{extra[1]}" if extra else ""),
                        ["recover", fx[n], "-o", "{OUT}", *extra, *NP], None))
    for n, fmt in [("w3_bf16_decay_tied_frozen", "fp32"), ("hf_w3_bf16_weights_tied", "hf"),
                   ("w2_bf16_small_subgroups_tied_frozen", "universal"),
                   ("s2_w3_fp32_decay_tied_frozen", "fp32")]:
        if n in fx:
            mpi.append((f"mpi2_export_{fmt}__{n}",
                        ["export", fx[n], "-o", "{OUT}", "--format", fmt, *NP], None))
    if "w2_fp32_one" in fx:
        t = tags(fx["w2_fp32_one"])
        mpi.append(("mpi2_diff__w2_fp32_one", ["diff", t[0], t[-1], "--json"], None))
    f = hostile["forged_model_z3"]
    mpi.append(("mpi2_refuse_forged_model_merge", ["merge", "{RECIPE}", *NP],
                parity_recipe(f / "global_step10", f / "global_step5")))
    mpi.append(("mpi2_refuse_truncated_export",
                ["export", hostile["truncated_optim"] / "global_step10", "-o", "{OUT}",
                 "--format", "fp32", *NP], None))
    for name, args, recipe in mpi:
        add(name, args, ranks=2, recipe=recipe)

    # -- phase 1: on what phase 0 wrote (a recovered composite, a resharded one)
    comp = out_of("recover__w2_parity")
    if "w2_parity" in fx:
        t = tags(fx["w2_parity"])
        add("composite_merge__w2_parity", ["merge", "{RECIPE}", *NP], phase=1,
            recipe=parity_recipe(comp, t[0]))
        add("composite_inspect__w2_parity", ["inspect", comp, "--json"], phase=1)
        add("composite_export_fp32__w2_parity", ["export", comp, "-o", "{OUT}", "--format",
                                                  "fp32", *NP], phase=1)
        add("composite_export_universal__w2_parity", ["export", comp, "-o", "{OUT}",
                                                       "--format", "universal", *NP], phase=1)
        if "w2_parity_twin_full" in fx:
            add("composite_diff_twin__w2_parity",
                ["diff", comp, tags(fx["w2_parity_twin_full"])[-1], "--json"], phase=1)
        ws3 = out_of("recover_ws3__w2_parity")
        add("resharded_export_fp32__w2_parity", ["export", ws3, "-o", "{OUT}", "--format",
                                                  "fp32", *NP], phase=1)
        add("resharded_diff__w2_parity", ["diff", comp, ws3, "--json"], phase=1)
        add("resharded_merge_ws2__w2_parity", ["merge", "{RECIPE}", "--world-size", "2", *NP],
            phase=1, recipe=parity_recipe(ws3, ws3))
    if "s1_w2_parity" in fx:
        ws3 = out_of("recover_ws3__s1_w2_parity")
        add("resharded_recover_back__s1_w2_parity", ["merge", "{RECIPE}", "--world-size", "2",
                                                     *NP], phase=1,
            recipe=parity_recipe(ws3, ws3))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    return cases


# ---------------------------------------------------------------- run

@dataclass
class Ctx:
    checkout: Path
    work: Path
    outdir: Path
    python: str
    mpiexec: str
    env: dict = field(default_factory=dict)


def normalise_text(text: str, ctx: Ctx, sort_lines: bool) -> str:
    # the fixtures first (longest first): a checkout may hold them (.cache/fixtures)
    for path, ph in sorted([(str(ctx.work), "<WORK>"), (str(ctx.outdir), "<OUTDIR>"),
                            (str(FIXTURES), "<FIXTURES>"), (str(ctx.checkout), "<CHECKOUT>")],
                           key=lambda x: -len(x[0])):
        text = text.replace(path, ph)
    text = re.sub(r"\bin \d+\.\d+ s\b", "in <S> s", text)
    text = re.sub(r"\(\d+\.\d+ GB/s\)", "(<R> GB/s)", text)
    lines = [ln for ln in text.splitlines() if not re.search(r"\bcopied .*\bETA\b", ln)]
    if sort_lines:
        lines.sort()
    return "\n".join(lines) + ("\n" if lines else "")


def spawn(cmd: list[str], env: dict, cwd: Path, logs: Path):
    """Run cmd in its own process group; (exit code or "timeout", stdout, stderr, CPU
    seconds of it and its descendants)."""
    import signal
    import threading
    logs.mkdir(parents=True)
    with open(logs / "stdout", "wb") as so, open(logs / "stderr", "wb") as se:
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=so, stderr=se,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    timed_out = []

    def kill():
        timed_out.append(True)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    timer = threading.Timer(TIMEOUT, kill)
    timer.start()
    _, status, ru = os.wait4(p.pid, 0)
    timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    code = "timeout" if timed_out else p.returncode
    return (code, (logs / "stdout").read_bytes(), (logs / "stderr").read_bytes(),
            round(ru.ru_utime + ru.ru_stime, 2))


def run_case(case: Case, ctx: Ctx) -> dict:
    cdir = ctx.work / "cases" / case.name
    cdir.mkdir(parents=True, exist_ok=True)
    out = cdir / "out"
    recipe = ctx.work / "recipes" / f"{case.name}.yml"
    if case.precreate_out:
        out.mkdir()
        (out / "keep.txt").write_text("was here first\n")
    if case.recipe is not None:
        recipe.write_text(case.recipe.replace("{OUT}", str(out)))
    args = [a.replace("{OUT}", str(out)).replace("{RECIPE}", str(recipe)) for a in case.args]
    cmd = [ctx.python, "-m", "mpitailor", *args]
    if case.ranks > 1:
        cmd = [ctx.mpiexec, "-n", str(case.ranks), *cmd]
    t = time.monotonic()
    code, so, se, cpu = spawn(cmd, ctx.env, cdir, ctx.work / "logs" / case.name)
    seconds = round(time.monotonic() - t, 2)
    files = {p.relative_to(cdir).as_posix(): output_hash(p)
             for p in sorted(cdir.rglob("*")) if p.is_file() and not p.is_symlink()}
    links = {p.relative_to(cdir).as_posix(): os.readlink(p)
             for p in sorted(cdir.rglob("*")) if p.is_symlink()}
    if case.target is not None:  # changed in place (prune): what is left of it
        files.update({"target/" + p.relative_to(case.target).as_posix(): output_hash(p)
                      for p in sorted(case.target.rglob("*"))
                      if p.is_file() and not p.is_symlink()})
    sort = case.ranks > 1
    shown_cmd = ([] if case.ranks == 1 else ["mpiexec", "-n", str(case.ranks)]) + \
        ["python", "-m", "mpitailor", *args]
    return {"case": case.name, "phase": case.phase, "ranks": case.ranks,
            "command": normalise_text(" ".join(shown_cmd), ctx, False).strip(),
            "recipe": normalise_text(recipe.read_text(), ctx, False) if case.recipe else None,
            "exit_code": code, "files": files, "links": links,
            "stdout": normalise_text(so.decode("utf-8", "backslashreplace"), ctx, False),
            "stderr": normalise_text(se.decode("utf-8", "backslashreplace"), ctx, sort),
            "stderr_sorted": sort, "seconds": seconds, "cpu_seconds": cpu}


def cmd_run(a: argparse.Namespace) -> int:
    checkout = Path(a.checkout).resolve()
    outdir = Path(a.out).resolve()
    work = Path(a.work).resolve()
    if not (checkout / "mpitailor" / "__init__.py").exists():
        sys.exit(f"{checkout}: no mpitailor/ package there")
    if outdir.exists() and any(outdir.iterdir()):
        sys.exit(f"{outdir}: exists and is not empty")
    lock = open(f"{work}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another run holds {work}.lock")
    t0 = time.monotonic()
    shutil.rmtree(work, ignore_errors=True)
    (work / "inputs").mkdir(parents=True)
    (work / "recipes").mkdir()
    (work / "cases").mkdir()
    (work / "logs").mkdir()
    env = child_env("MPITAILOR_")
    env.pop("PYTHONPATH", None)
    env.update(PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1")
    ctx = Ctx(checkout, work, outdir, a.python, a.mpiexec, env)
    where = subprocess.run([a.python, "-c", "import mpitailor; print(mpitailor.__file__)"],
                           env=env, cwd=work, capture_output=True, text=True)
    if where.returncode != 0 or not Path(where.stdout.strip()).resolve().is_relative_to(checkout):
        sys.exit(f"PYTHONPATH={checkout} does not import mpitailor from there: "
                 f"{where.stdout.strip()} {where.stderr.strip()}")

    fx = find_fixtures()
    hostile = build_hostile(fx, work / "inputs")
    cases = build_cases(fx, hostile, work)
    if a.only:
        cases = [c for c in cases if re.search(a.only, c.name)]
    inputs = {f"fixture:{n}": tree_digest(p) for n, p in fx.items()}
    inputs.update({f"hostile:{n}": tree_digest(p) for n, p in hostile.items()})
    print(f"{len(cases)} cases, {len(fx)} fixtures; mpitailor from {checkout}", flush=True)

    results: dict[str, dict] = {}
    for phase in (0, 1):
        todo = [c for c in cases if c.phase == phase]
        with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
            futs = {pool.submit(run_case, c, ctx): c for c in todo}
            for fut in concurrent.futures.as_completed(futs):
                res = fut.result()
                results[res["case"]] = res
                if a.verbose:
                    print(f"  {res['case']:<60} exit {res['exit_code']}  {res['seconds']} s "
                          f"({res['cpu_seconds']} CPU s)",
                          flush=True)
    payload_ran = (work / "inputs" / "PAYLOAD_RAN").exists()
    after = {f"hostile:{n}": tree_digest(p) for n, p in hostile.items()
             if not n.startswith("prune_")}
    changed = [k for k, v in after.items() if v != inputs[k]]
    changed += [f"fixture:{n}" for n, p in fx.items() if tree_digest(p) != inputs[f"fixture:{n}"]]

    outdir.mkdir(parents=True, exist_ok=True)
    for name, res in results.items():
        dst = outdir / name
        dst.mkdir()
        shutil.move(str(work / "cases" / name), str(dst / "tree"))
        (dst / "result.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    seconds = round(time.monotonic() - t0, 1)
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain"],
                           capture_output=True, text=True).stdout.splitlines()
    run = {"checkout": str(checkout), "head": head, "dirty": dirty, "python": a.python,
           "work": str(work), "fixtures": str(FIXTURES), "inputs": inputs,
           "payload_ran": payload_ran, "inputs_changed_by_run": changed,
           "cases": sorted(results), "seconds": seconds}
    (outdir / "run.json").write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    codes: dict = {}
    for res in results.values():
        codes[res["exit_code"]] = codes.get(res["exit_code"], 0) + 1
    cpu = round(sum(r["cpu_seconds"] for r in results.values()), 1)
    run["cpu_seconds"] = cpu
    (outdir / "run.json").write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    print(f"{len(results)} cases in {seconds} s ({cpu} CPU s in the commands); exit codes "
          f"{codes}; written to {outdir}")
    if payload_ran:
        print("WARNING: a forged pickle's payload RAN")
    if changed:
        print(f"WARNING: the run changed inputs: {changed}")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if payload_ran or changed else 0


# ---------------------------------------------------------------- compare

def _text_diff(a: str, b: str, what: str, limit: int = 40) -> list[str]:
    lines = list(difflib.unified_diff(a.splitlines(), b.splitlines(), f"A {what}", f"B {what}",
                                      lineterm="", n=1))
    return lines[:limit] + ([f"    ... {len(lines) - limit} more diff lines"]
                            if len(lines) > limit else [])


def _fixtures_named(result: dict) -> dict:
    """The fixtures' paths as one placeholder in a result's texts, whether the run wrote them
    out or as <CHECKOUT>/.cache/fixtures (a checkout that holds them)."""
    for key in ("command", "recipe", "stdout", "stderr"):
        if isinstance(result.get(key), str):
            result[key] = result[key].replace("<CHECKOUT>/.cache/fixtures", "<FIXTURES>") \
                .replace(str(FIXTURES), "<FIXTURES>")
    return result


def cmd_compare(a: argparse.Namespace) -> int:
    A, B = Path(a.a), Path(a.b)
    ra, rb = (json.loads((d / "run.json").read_text()) for d in (A, B))
    diffs: list[str] = []
    if ra["work"] != rb["work"]:
        print(f"cannot compare: made in different work dirs ({ra['work']} vs {rb['work']}); "
              f"manifests record output paths")
        return 2
    for k in sorted(set(ra["inputs"]) | set(rb["inputs"])):
        if ra["inputs"].get(k) != rb["inputs"].get(k):
            diffs.append(f"[input] {k}: digest {ra['inputs'].get(k, 'missing')[:16]} vs "
                         f"{rb['inputs'].get(k, 'missing')[:16]} (the input differs, not the code)")
    for side, r in (("A", ra), ("B", rb)):
        if r["payload_ran"]:
            diffs.append(f"[{side}] a forged pickle's payload ran")
        if r["inputs_changed_by_run"]:
            diffs.append(f"[{side}] the run changed inputs: {r['inputs_changed_by_run']}")
    ca, cb = set(ra["cases"]), set(rb["cases"])
    for c in sorted(ca - cb):
        diffs.append(f"[{c}] case missing in B")
    for c in sorted(cb - ca):
        diffs.append(f"[{c}] case missing in A")
    for c in sorted(ca & cb):
        x, y = (_fixtures_named(json.loads((d / c / "result.json").read_text()))
                for d in (A, B))
        if x["command"] != y["command"]:
            diffs.append(f"[{c}] command differs: {x['command']!r} vs {y['command']!r}")
        if x.get("recipe") != y.get("recipe"):
            diffs.append(f"[{c}] recipe differs")
        if x["exit_code"] != y["exit_code"]:
            diffs.append(f"[{c}] exit code {x['exit_code']} vs {y['exit_code']}")
        for f in sorted(set(x["files"]) | set(y["files"])):
            if f not in y["files"]:
                diffs.append(f"[{c}] file missing in B: {f}")
            elif f not in x["files"]:
                diffs.append(f"[{c}] file missing in A: {f}")
            elif x["files"][f] != y["files"][f]:
                diffs.append(f"[{c}] hash differs: {f} ({x['files'][f][:16]} vs "
                             f"{y['files'][f][:16]})")
        if x.get("links") != y.get("links"):
            diffs.append(f"[{c}] symlinks differ: {x.get('links')} vs {y.get('links')}")
        for stream in ("stdout", "stderr"):
            if x[stream] != y[stream]:
                diffs.append(f"[{c}] {stream} text differs:\n    " +
                             "\n    ".join(_text_diff(x[stream], y[stream], stream)))
    for d in diffs:
        print(d)
    print(f"{len(ca & cb)} cases compared: "
          f"{'no difference' if not diffs else f'{len(diffs)} difference(s)'}")
    return 1 if diffs else 0


def cmd_list(a: argparse.Namespace) -> int:
    fx = find_fixtures()
    hostile = {n: Path(f"<WORK>/inputs/{n}") for n in
               ("not_a_checkpoint", "forged_model_z3", "forged_optim_z3", "forged_model_s1",
                "truncated_optim", "tripwire_client_state", "prune_w2_parity",
                "prune_dry_w2_parity")}
    for c in build_cases(fx, hostile, DEFAULT_WORK):
        print(f"{c.name:<62} ranks={c.ranks} phase={c.phase}  " + " ".join(c.args))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the cases with a checkout's code, record outputs")
    r.add_argument("--checkout", required=True, help="dir whose mpitailor/ package runs")
    r.add_argument("--out", required=True, help="where the record goes (must be empty)")
    r.add_argument("--work", default=str(DEFAULT_WORK),
                   help="fixed scratch dir the commands write in (same for runs to compare)")
    r.add_argument("--python", default=str(VENV / "python"))
    r.add_argument("--mpiexec", default=str(VENV / "mpiexec"))
    r.add_argument("--jobs", type=int, default=3, help="cases run at once")
    r.add_argument("--only", help="regex: run only the matching cases (for debugging)")
    r.add_argument("-v", "--verbose", action="store_true", help="a line per case")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="compare two records; exit 1 on any difference")
    c.add_argument("a")
    c.add_argument("b")
    c.set_defaults(func=cmd_compare)
    ls = sub.add_parser("list", help="print the cases")
    ls.set_defaults(func=cmd_list)
    a = p.parse_args()
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
