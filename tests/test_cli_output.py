"""What a user sees of the real CLI, under mpiexec where it matters: progress lines on a pipe
(a bar on a terminal), recover's summary, a quiet end when stdout's reader leaves, and each
error said once."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from merging import MPIEXEC, RECIPES, REPO, recipe_env, run_cli
from test_merge_errors import error_lines

from mpitailor.engine.progress import ENV, Progress

LINE = re.compile(r"^mpitailor: copied ([\d.]+ [kMG]?B) of "
                  r"([\d.]+ [kMG]?B) \((\d+)%\), [\d.]+ [kMG]?B/s, ETA (\d+ s|unknown) "
                  r"\(estimated from rank 0's share, of 2 ranks\)$", re.M)


def parity_env(ckpt, out):
    return recipe_env(ckpt("w2_fp32_wide", 6), ckpt("w2_fp32_wide", 3), out)


def test_progress_is_logged_by_rank_0_on_a_pipe(ckpt, tmp_path):
    """stderr is a pipe, as under mpiexec or srun: rank 0 logs lines (an interval of 0 s
    stands in for a merge of minutes: every range copied is reported), never a bar."""
    env = {**parity_env(ckpt, tmp_path / "m"), ENV: "0"}
    r = run_cli([str(RECIPES / "parity.yml")], env, ranks=2)
    assert r.returncode == 0, r.stderr
    lines = LINE.findall(r.stderr)
    assert lines, r.stderr
    done, total, percent, _ = lines[-1]
    assert (done, percent) == (total, "100"), lines  # the last range ends the copy
    assert "progress" not in r.stderr, r.stderr
    assert "\r" not in r.stderr and "[rank 1] mpitailor: copied" not in r.stderr, r.stderr
    for off in (["--no-progress"], ["-q"]):
        r = run_cli([str(RECIPES / "parity.yml"), *off], {**env, "OUT": str(tmp_path / off[0])},
                    ranks=2)
        assert r.returncode == 0 and not LINE.search(r.stderr), (off, r.stderr)


def test_progress_is_a_bar_on_a_terminal(ckpt, tmp_path):
    leader, follower = pty.openpty()
    # 24 x 80: a terminal of no width gets a bar of no characters
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**os.environ, **parity_env(ckpt, tmp_path / "m"), ENV: "0"}
    job = subprocess.Popen([sys.executable, "-m", "mpitailor", str(RECIPES / "parity.yml")],
                           env=env, stdout=subprocess.PIPE, stderr=follower, cwd=REPO)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's last writer closed it
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert job.wait(timeout=180) == 0, seen
    assert b"rank 0 copies" in seen and b"mpitailor: copied" not in seen, seen


def test_progress_line_says_what_it_estimates(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    p = Progress(mine=500, total=1000, ranks=2)  # rank 0 copies half of the job's bytes
    p.update(250)
    assert p.line(2.0) == ("copied 500 B of 1.00 kB (50%), 250 B/s, ETA 2 s "
                           "(estimated from rank 0's share, of 2 ranks)")
    alone = Progress(mine=3_000_000, total=3_000_000, ranks=1)
    assert alone.line(0.0) == "copied 0 B of 3.00 MB (0%), 0 B/s, ETA unknown"
    monkeypatch.setenv(ENV, "soon")
    assert Progress(1, 1, 1).interval == 5.0  # a bad value: the default, with a warning


def test_recover_names_the_step_world_size_and_the_saves_it_skipped(ckpt_copy, tmp_path):
    save = ckpt_copy("w2_parity")  # full save at 2, partial saves at 4, 6, 8
    r = run_cli(["recover", str(save), "-o", str(tmp_path / "a"), "--world-size", "3"], {},
                ranks=2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == \
        "mpitailor: recovered step 8 for world size 3 from global_step6, global_step8", r.stdout
    victim = save / "global_step8" / "rank_1_optim_meta.pt"
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:100])
    r = run_cli(["recover", str(save), "-o", str(tmp_path / "b")], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == (
        f"mpitailor: recovered step 6 for world size 2 from global_step4, global_step6; "
        f"skipped global_step8 ({victim}: 100 bytes, but the partial save wrote {size}; the "
        f"file is truncated or damaged)"), r.stdout


def run_into_a_closed_pipe(args: list[str], ranks: int) -> subprocess.CompletedProcess:
    """The command with stdout a pipe whose reader has left (`... | head -1` once head is
    done): every write to it fails with EPIPE."""
    reader, writer = os.pipe()
    os.close(reader)
    cmd = [sys.executable, "-m", "mpitailor", *args]
    if ranks > 1:
        cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    try:
        return subprocess.run(cmd, stdout=writer, stderr=subprocess.PIPE, text=True,
                              timeout=180, cwd=REPO, env=env)
    finally:
        os.close(writer)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_reader_that_leaves_ends_the_command_quietly(ckpt, ranks):
    from ckpt_fixtures import build
    save = build("w2_parity")
    commands = [["recover", str(save), "--emit-recipe"], ["recover", str(save), "--dry-run"],
                ["diff", str(save / "global_step2"), str(save / "global_step8")]]
    if ranks == 1:
        commands.append(["inspect", str(save / "global_step2")])
    for args in commands:
        r = run_into_a_closed_pipe(args, ranks)
        assert "Traceback" not in r.stderr and "Broken pipe" not in r.stderr, (args, r.stderr)
        assert "Exception ignored" not in r.stderr and r.stderr == "", (args, r.stderr)
        # 128 + SIGPIPE, as a shell reports a tool ended by it; mpiexec is ended by it itself
        assert r.returncode in ((141,) if ranks == 1 else (141, -13)), (args, r.returncode)


DRIVER = """
import importlib, os, sys
cli = importlib.import_module("mpitailor.cli.main")
parser = importlib.import_module("mpitailor.cli.parser")
from mpitailor.errors import UserError

def fail(args):
    comm = args.comm
    if os.environ["HOW"] == "alone":  # rank 1 fails outside any collective; rank 0 waits in one
        if comm.rank == 1:
            raise UserError("only rank 1 saw this")
        comm.barrier()
    raise UserError(f"rank {comm.rank} saw its own thing")

parser.cmd_merge = fail  # the command's body: the rest of main (parsing, MPI, errors) as shipped
sys.exit(cli.main(["merge", "unused.yml"]))
"""


@pytest.mark.parametrize("how", ["differ", "alone"])
def test_errors_that_differ_or_only_one_rank_sees_are_said_by_each_rank(tmp_path, how):
    """Ranks that failed with different messages each say theirs, prefixed; a rank that
    failed alone while the others wait in a collective says its own and ends the job
    (MPI_Finalize would wait for them forever): no hang, no line lost."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    r = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(driver)],
                       env={**env, "HOW": how}, capture_output=True, text=True, timeout=120,
                       cwd=REPO)
    # Alone, the failing rank exits 2 and hydra ends the job by killing the rank still
    # waiting: mpiexec then reports 2 or that rank's 9, whichever it sees first.
    assert r.returncode in ((2, 9) if how == "alone" else (2,)), r.stderr
    want = ["[rank 1] mpitailor: error: only rank 1 saw this"] if how == "alone" else \
        [f"[rank {k}] mpitailor: error: rank {k} saw its own thing" for k in (0, 1)]
    assert sorted(error_lines(r.stderr)) == want, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("argv,subcommand", [
    (["-q", "recipe.yml"], ["merge", "-q", "recipe.yml"]),
    (["recipe.yml", "-q"], ["merge", "recipe.yml", "-q"]),
    (["-v", "recover", "run", "-o", "x"], ["recover", "-v", "run", "-o", "x"]),
    (["inspect", "-q", "x"], ["inspect", "-q", "x"]),
    (["--help"], ["--help"]),
])
def test_options_before_the_recipe_or_the_subcommand(argv, subcommand):
    """D7 of issue 41: `mpitailor -q recipe.yml` was argparse's 'invalid choice'."""
    from mpitailor.cli.parser import with_subcommand
    assert with_subcommand(argv) == subcommand


def test_an_option_before_the_recipe_reaches_the_recipes_error(tmp_path):
    r = run_cli(["-q", str(tmp_path / "missing.yml")], {})
    assert r.returncode == 2 and r.stderr.startswith("mpitailor: error: "), r.stderr
    assert "missing.yml" in r.stderr and "invalid choice" not in r.stderr, r.stderr


def test_export_says_its_step_and_saves_and_q_is_quiet(ckpt, tmp_path):
    """The export summary names the step and the saves the layers came from; -q prints
    nothing but warnings and errors (issue 41: it printed the summary)."""
    from ckpt_fixtures import build
    run = build("w2_parity")
    r = run_cli(["export", str(run), "-o", str(tmp_path / "a"), "--format", "fp32"], {})
    assert r.returncode == 0, r.stderr
    assert "(step 8, from global_step6, global_step8) as fp32" in r.stdout, r.stdout
    r = run_cli(["export", str(run), "-o", str(tmp_path / "b"), "--format", "fp32", "-q"], {})
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    r = run_cli(["recover", str(run), "-o", str(tmp_path / "c"), "-q"], {})
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
