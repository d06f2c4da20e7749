"""The merge side runs without torch and DeepSpeed (issue 33): the core install
(`pip install mpitailor`: the command line, the merge side, the Slurm prologue) has neither.

Each command runs for real (under `mpiexec -n 2` where it uses MPI) in this venv, where torch,
DeepSpeed, transformers, accelerate and h5py are all installed and importable; a witness in
every Python process of the command (each rank, and each Python the Slurm prologue starts)
writes down, as the process ends (or execs), which of them it had loaded, and which
mpitailor line imported each first. Every list must be empty. tests/test_layering.py reads
the same rule from the source; this test sees what actually runs (a pickle's class looked up
by name, an import through a third-party package) as well.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ckpt_fixtures import build, tag_dir
from merging import MPIEXEC, RECIPES, recipe_env, run_cli
from test_layering import modules

TRAINING_ONLY = ("torch", "deepspeed", "transformers", "accelerate", "h5py")
RANKS = 2

# sitecustomize.py on PYTHONPATH: every Python started with this environment runs it first.
# A finder at the head of sys.meta_path notes, for the first import of each top-level
# training-only module, the mpitailor frames that asked for it (and lets the import go on);
# at exit, and before an exec replaces the process (`slurm-prologue` execs bash), the
# process writes its record into $MPITAILOR_WITNESS_DIR. (It shadows an installation's own
# sitecustomize, which this venv does not have.)
WITNESS = textwrap.dedent("""
    import atexit, json, os, sys, traceback

    _HEAVY = {heavy!r}
    _chains = {{}}
    _dir = os.environ["MPITAILOR_WITNESS_DIR"]


    class _Witness:
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in _HEAVY and top not in _chains:
                stack = traceback.extract_stack()[:-1]
                ours = [f"{{f.filename}}:{{f.lineno}}: {{f.line}}" for f in stack
                        if "/mpitailor/" in f.filename]
                last = [f"{{f.filename}}:{{f.lineno}}: {{f.line}}" for f in stack
                        if "importlib" not in f.filename][-1:]
                _chains[top] = ours or last
            return None


    def _record():
        loaded = sorted(m for m in list(sys.modules) if m.partition(".")[0] in _HEAVY)
        rec = {{"argv": list(getattr(sys, "orig_argv", sys.argv)), "pid": os.getpid(),
               "rank": os.environ.get("PMI_RANK"), "loaded": loaded, "chains": _chains}}
        name = f"{{os.getpid()}}-{{os.urandom(4).hex()}}.json"
        with open(os.path.join(_dir, name), "w") as f:
            json.dump(rec, f)


    def _before_exec(real):
        def execute(*args, **kwargs):
            _record()
            return real(*args, **kwargs)
        return execute


    sys.meta_path.insert(0, _Witness())
    atexit.register(_record)
    os.execv, os.execve = _before_exec(os.execv), _before_exec(os.execve)
""").format(heavy=TRAINING_ONLY)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("witness-site")
    (d / "sitecustomize.py").write_text(WITNESS)
    return d


def witnessed(site: Path, tmp_path: Path, args: list[str], ranks: int, env=None):
    """Run `python -m mpitailor ARGS` (under mpiexec -n ranks when ranks > 1) with the
    witness in every Python process; the result and the records of those processes."""
    records_dir = tmp_path / "witness"
    records_dir.mkdir()
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    r = run_cli(args, {**(env or {}), "PYTHONPATH": path,
                       "MPITAILOR_WITNESS_DIR": str(records_dir)}, ranks=ranks, timeout=300)
    records = [json.loads(p.read_text()) for p in sorted(records_dir.glob("*.json"))]
    return r, records


def assert_torch_free(r, records, ranks: int, expect_rc: int = 0) -> None:
    assert r.returncode == expect_rc, f"exit {r.returncode}\n{r.stderr}"
    mine = [x for x in records if "mpitailor" in " ".join(x["argv"])]
    assert len(mine) >= ranks, (f"{len(mine)} witness record(s) for {ranks} rank(s): a "
                                f"process ended without running its exit handlers\n{r.stderr}")
    heavy = []
    for x in records:
        if not x["loaded"]:
            continue
        top = sorted({m.partition(".")[0] for m in x["loaded"]})
        where = "; ".join(f"{name} first imported by: " + " <- ".join(reversed(chain))
                          for name, chain in sorted(x["chains"].items()))
        heavy.append(f"rank {x['rank']} of `{shlex.join(x['argv'])}` loaded {', '.join(top)} "
                     f"({len(x['loaded'])} modules: {', '.join(x['loaded'][:5])}, ...); "
                     f"{where}")
    assert not heavy, "the merge side loaded training-only modules:\n" + "\n".join(heavy)


@pytest.fixture(scope="module")
def parity():
    """A full save (step 2) and a partial save (step 4: layers 1 and 3, embed, norm and
    lm_head) of a layer-wise run: parity takes the even layers from the full one (NEW) and
    the odd ones from the partial one (OLD)."""
    save = build("w2_parity")
    return save / "global_step2", save / "global_step4"


def test_merge_of_a_full_and_a_partial_save(site, tmp_path, parity):
    out = tmp_path / "merged"
    r, records = witnessed(site, tmp_path, [str(RECIPES / "parity.yml"), "--verify"],
                           RANKS, recipe_env(*parity, out))
    assert_torch_free(r, records, RANKS)
    assert (out / "latest").is_file() and "mpitailor:" in r.stdout, r.stdout


def test_merge_dry_run(site, tmp_path, parity):
    out = tmp_path / "merged"
    r, records = witnessed(site, tmp_path, ["merge", str(RECIPES / "parity.yml"), "--dry-run"],
                           RANKS, recipe_env(*parity, out))
    assert_torch_free(r, records, RANKS)
    assert r.stdout.strip() and not out.exists(), r.stdout


@pytest.mark.parametrize("run", ["w2_parity", "hf_w2_parity", "s2_w3_bf16_parity"])
def test_recover(site, tmp_path, run):
    """ZeRO-3, the HF Trainer's checkpoint-N/ (training_args.bin, rng states: pickles of
    transformers' and torch's classes, carried as they are) and ZeRO stage 2."""
    out = tmp_path / "recovered"
    r, records = witnessed(site, tmp_path, ["recover", str(build(run)), "-o", str(out)], RANKS)
    assert_torch_free(r, records, RANKS)
    assert (out / "latest").is_file() and "mpitailor: recovered step 8" in r.stdout, r.stdout


def test_recover_for_another_world_size(site, tmp_path):
    out = tmp_path / "recovered"
    r, records = witnessed(site, tmp_path, ["recover", str(build("w2_parity")), "-o", str(out),
                                            "--world-size", "3"], RANKS)
    assert_torch_free(r, records, RANKS)
    assert "for world size 3" in r.stdout, r.stdout
    assert (out / "latest").is_file()


def test_recover_dry_run(site, tmp_path):
    r, records = witnessed(site, tmp_path, ["recover", str(build("w2_parity")), "--dry-run"],
                           RANKS)
    assert_torch_free(r, records, RANKS)
    assert "layers.0" in r.stdout, r.stdout


@pytest.mark.parametrize("fmt,run", [("fp32", "w2_parity"), ("hf", "hf_w2_parity"),
                                     ("universal", "w2_parity")])
def test_export(site, tmp_path, fmt, run):
    out = tmp_path / fmt
    r, records = witnessed(site, tmp_path, ["export", str(build(run)), "-o", str(out),
                                            "--format", fmt], RANKS)
    assert_torch_free(r, records, RANKS)
    assert out.is_dir() and any(out.iterdir()) and r.stdout.strip(), r.stdout


def test_export_of_a_dcp_checkpoint(site, tmp_path):
    """A DCP checkpoint's model as HF weights (--config: the fixture's tiny config.json,
    written by this process, which the witness does not watch)."""
    from ckpt_fixtures import spec_for

    from dev.tinytrain.model import tiny_config
    run = build("dcp_w2_fsdp2")
    tiny_config(spec_for("dcp_w2_fsdp2", run)).save_pretrained(tmp_path / "config")
    out = tmp_path / "hf"
    r, records = witnessed(site, tmp_path, ["export", str(run / "step-4"), "-o", str(out),
                                            "--config", str(tmp_path / "config"),
                                            "--dtype", "bf16"], RANKS)
    assert_torch_free(r, records, RANKS)
    assert (out / "model.safetensors").is_file() and r.stdout.strip(), r.stdout


@pytest.mark.parametrize("a,b", [(("w2_parity", 2), ("w2_parity", 8)),
                                 # 16-bit weights in model.safetensors, compared too
                                 (("hf_w3_bf16_weights_tied", 10),
                                  ("hf_w3_bf16_weights_tied", 5)),
                                 # stage 2: the 16-bit weights of the model-states file
                                 (("s2_w2_bf16_per_layer", 10), ("s2_w2_bf16_per_layer", 5))])
def test_diff(site, tmp_path, a, b):
    """Two saves of a run differ: exit 1, and the report says where."""
    r, records = witnessed(site, tmp_path, ["diff", "--json", str(tag_dir(*a)),
                                            str(tag_dir(*b))], RANKS)
    assert_torch_free(r, records, RANKS, expect_rc=1)
    rep = json.loads(r.stdout)
    assert rep["identical"] is False and rep["layers"], r.stdout


@pytest.mark.parametrize("step", [2, 4])
def test_inspect(site, tmp_path, step):
    """Serial (no MPI): a full save and a partial save."""
    r, records = witnessed(site, tmp_path, ["inspect", str(tag_dir("w2_parity", step))], 1)
    assert_torch_free(r, records, 1)
    assert "layers.1" in r.stdout, r.stdout


def test_clean(site, tmp_path):
    """Serial (no MPI): a staging dir a killed merge left is removed."""
    work = tmp_path / "outputs"
    left = work / ".merged.mpitailor-staging"
    left.mkdir(parents=True)
    (left / "mp_rank_00_model_states.pt").write_bytes(b"half")
    r, records = witnessed(site, tmp_path, ["clean", str(work)], 1)
    assert_torch_free(r, records, 1)
    assert not left.exists() and "mpitailor:" in r.stdout, r.stdout


def test_prune_dry_run(site, tmp_path):
    r, records = witnessed(site, tmp_path, ["prune", str(build("w2_parity")), "--keep-last",
                                            "1", "--dry-run"], RANKS)
    assert_torch_free(r, records, RANKS)
    assert "would remove" in r.stdout, r.stdout


def test_slurm_prologue(site, tmp_path):
    """The shipped resume prologue (bash): it plans with `recover --emit-recipe`, merges
    with `$MPITAILOR_LAUNCH python -m mpitailor recover` on 2 ranks, and checks the result
    with `python -c` (mpitailor.formats.zero.files): every one of those Pythons is witnessed."""
    out = tmp_path / "resume"
    env = {"MPITAILOR_LAUNCH": f"{MPIEXEC} -n {RANKS}"}
    r, records = witnessed(site, tmp_path, ["slurm-prologue", str(build("w2_parity")),
                                            str(out)], 1, env)
    # the command itself, the planning recover, 2 merge ranks, the checks (python -c)
    assert_torch_free(r, records, 1 + 1 + RANKS)
    assert any("-c" in x["argv"] for x in records), [x["argv"] for x in records]
    assert r.stdout == f"MPITAILOR_RESUME_FROM={out / 'recovered-step8'}\n", r.stderr
    assert (out / "recovered-step8" / "latest").is_file()


def test_the_witness_sees_a_training_side_import(site, tmp_path):
    """`stats plot` is the training side's (h5py, matplotlib): the witness names h5py and
    the mpitailor line that imported it, so the empty lists above mean what they say."""
    stats = build("w2_parity") / "stats.h5"
    r, records = witnessed(site, tmp_path, ["stats", "plot", str(stats), "-o",
                                            str(tmp_path / "plot.png")], 1)
    assert r.returncode == 0, r.stderr
    with pytest.raises(AssertionError) as seen:
        assert_torch_free(r, records, 1)
    assert "loaded h5py" in str(seen.value), seen.value
    assert "mpitailor/training/plot.py" in str(seen.value), seen.value


# Run in a fresh interpreter: a finder placed first on sys.meta_path notes which mpitailor
# frames asked for a heavy module the first time, then lets the import go on as usual.
CHILD = textwrap.dedent("""
    import sys, traceback

    HEAVY = {heavy!r}
    chains = {{}}

    class Witness:
        def find_spec(self, name, path=None, target=None):
            if name in HEAVY and name not in chains:
                chains[name] = [f"{{f.filename}}:{{f.lineno}}: {{f.line}}"
                                for f in traceback.extract_stack()
                                if "/mpitailor/" in f.filename]
            return None

    sys.meta_path.insert(0, Witness())
    for module in {modules!r}:
        __import__(module)
    for name in HEAVY:
        if name in sys.modules:
            print(f"{{name}} loaded by:")
            print("\\n".join("  " + line for line in chains.get(name, ["?"])))
""")


def test_planning_loads_neither_torch_nor_mpi4py():
    """The pure planner imports neither (a static rule is test_layering's)."""
    planning = [m for m, _ in modules() if m.startswith("mpitailor.planning.")]
    assert len(planning) >= 5
    code = CHILD.format(heavy=("torch", "mpi4py"), modules=planning)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert not out.stdout, f"importing mpitailor.planning:\n{out.stdout}"
