"""Issue 32's hostile review, outside the checkpoint readers: `clean` where it cannot look or
remove, paths that are not UTF-8 or hold control characters, who holds a lock, `--stats`
through a link, onto a device or a full disk, and max_host_bytes that are not sizes. The
real CLI (under mpiexec where MPI matters), real DeepSpeed fixtures."""
from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from merging import MPIEXEC, RECIPES, REPO, run_cli
from test_merge_errors import error_lines, expect_one_error

from mpitailor.display import escaped, shown
from mpitailor.errors import UserError
from mpitailor.training.snapshot import host_bytes_limit

NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def run_clean(folder: Path, as_plain_user: bool = False):
    """`python -m mpitailor clean FOLDER`; as_plain_user: without root's right to read and
    write past permission bits (tests run as root)."""
    cmd = [sys.executable, "-m", "mpitailor", "clean", str(folder)]
    if as_plain_user and os.geteuid() == 0:
        cmd = [*NO_DAC, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)


def no_traceback(r) -> None:
    assert "Traceback" not in r.stderr and "unexpected failure" not in r.stderr, r.stderr


@contextmanager
def immutable(path: Path):
    """chattr +i: not even root can remove it (or, for a dir, what is in it)."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i does not work on this file system")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def needs_plain_user() -> None:
    if os.geteuid() == 0 and subprocess.run([*NO_DAC, "true"], capture_output=True).returncode:
        pytest.skip("cannot drop root's permission override here (setpriv)")


# -- 5. clean -------------------------------------------------------------------------------

def test_clean_names_each_leftover_it_cannot_remove(tmp_path):
    stuck = tmp_path / ".stuck.mpitailor-staging"
    stuck.mkdir()
    (stuck / "rank_0.pt").write_bytes(b"x")
    gone = tmp_path / ".gone.mpitailor-staging"
    gone.mkdir()
    with immutable(stuck):  # its file cannot be unlinked, even by root
        r = run_clean(tmp_path)
    no_traceback(r)
    assert r.returncode == 1, r.stderr
    assert r.stdout.splitlines() == [f"mpitailor: removed {gone}"]
    assert f"mpitailor: not cleaned: {stuck}: cannot remove it (Operation not permitted)" \
        in r.stderr.splitlines(), r.stderr
    expect_one_error(r, f"1 path(s) under {tmp_path} could not be looked at or removed", 1)
    assert not gone.exists() and stuck.is_dir()


def test_clean_of_a_leftover_beside_a_lock_it_cannot_take(tmp_path):
    """An immutable directory: no lock can be made there, so its leftovers stay, each said."""
    sub = tmp_path / "run"
    sub.mkdir()
    (sub / ".out.mpitailor-staging").mkdir()
    (sub / ".out.mpitailor-old").mkdir()
    with immutable(sub):
        r = run_clean(tmp_path)
    no_traceback(r)
    assert r.returncode == 1 and "nothing to clean" not in r.stdout, (r.stdout, r.stderr)
    for name in (".out.mpitailor-old", ".out.mpitailor-staging"):
        assert f"mpitailor: not cleaned: {sub / name}: not removed: cannot take the lock " \
               f"{sub / '.out.mpitailor-lock'} (Operation not permitted)" in r.stderr, r.stderr
    expect_one_error(r, "2 path(s) under", 1)


@pytest.mark.parametrize("which", ["the directory", "a subdirectory"])
def test_clean_never_says_nothing_to_clean_where_it_could_not_look(tmp_path, which):
    needs_plain_user()
    shut = tmp_path if which == "the directory" else tmp_path / "sub"
    shut.mkdir(exist_ok=True)
    (shut / ".out.mpitailor-staging").mkdir()
    shut.chmod(0)
    try:
        r = run_clean(tmp_path, as_plain_user=True)
    finally:
        shut.chmod(0o755)
    no_traceback(r)
    assert r.returncode == 1 and "nothing to clean" not in r.stdout, (r.stdout, r.stderr)
    assert f"mpitailor: not cleaned: {shut}: cannot list it (Permission denied)" in r.stderr
    assert (shut / ".out.mpitailor-staging").is_dir()


def test_clean_shows_odd_names_escaped(tmp_path):
    name = ".x\nmpitailor: removed etc\x1b[2J.mpitailor-staging"
    (tmp_path / name).mkdir()
    r = run_clean(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"mpitailor: removed {shown(tmp_path / name)}"]
    assert "\x1b" not in r.stdout and r.stdout.count("\n") == 1


# -- 6. paths that are not UTF-8, control characters ----------------------------------------

def test_shown_and_escaped():
    assert shown("/plain/path with space") == "/plain/path with space"
    assert shown(os.fsdecode(b"/d/dir\xff")) == "$'/d/dir\\xff'"
    assert shown("a\nb\x1b[31m'\\") == "$'a\\nb\\e[31m\\'\\\\'"
    assert escaped(os.fsdecode(b"x\xfe\ny\tz") + "\u202e") == "x\\xfe\\ny\tz\\u202e"


@pytest.mark.parametrize("name,shows", [
    (os.fsdecode(b"gone\xff"), "gone\\xff"),
    ("gone\nmpitailor: merged 7 layers\x1b[2J", "gone\\nmpitailor: merged 7 layers\\e[2J")])
def test_a_bad_name_in_an_error_is_one_escaped_line(name, shows):
    r = run_cli(["inspect", name], {})
    no_traceback(r)
    assert r.stderr == f"mpitailor: error: {shows}: no such checkpoint; check the path\n"
    assert r.returncode == 2 and "\x1b" not in r.stderr


def test_a_checkpoint_under_a_path_that_is_not_utf8(ckpt_copy, tmp_path):
    src = ckpt_copy("w2_fp32_one")
    odd = tmp_path / os.fsdecode(b"dir\xff")
    src.rename(odd)
    r = run_cli(["inspect", str(odd / "global_step10")], {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"checkpoint   {shown(odd / 'global_step10')}"
    out = tmp_path / os.fsdecode(b"out\xfe")
    r = run_cli(["recover", str(odd), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert f"into {shown(out)}: " in r.stdout and (out / "global_step10").is_dir()
    plain = tmp_path / "plain"
    r = run_cli(["recover", str(odd), "-o", str(plain)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    r = run_cli(["diff", str(out), str(plain)], {}, ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr  # the same weights, whatever the names


# -- rough edges: who holds a lock, --stats -------------------------------------------------

def fixture_env(ckpt, out: Path) -> dict[str, str]:
    return {"NEW": str(ckpt("w2_fp32_one", 10)), "OLD": str(ckpt("w2_fp32_one", 5)),
            "OUT": str(out)}


def test_a_merge_says_a_clean_holds_its_lock(ckpt, tmp_path):
    out = tmp_path / "merged"
    (tmp_path / ".merged.mpitailor-staging").mkdir()  # a killed run's
    (tmp_path / ".merged.mpitailor-lock").touch()
    gate = tmp_path / "gate"
    gate.mkdir()
    clean = subprocess.Popen(
        [sys.executable, "-m", "mpitailor", "clean", str(tmp_path)], cwd=REPO,
        env={**os.environ, "MPITAILOR_FAILPOINT": f"reclaim/merged:0:pause={gate}"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (gate / "reached").exists():
            assert clean.poll() is None and time.monotonic() < deadline, clean.communicate()
            time.sleep(0.05)
        r = run_cli([str(RECIPES / "parity.yml")], fixture_env(ckpt, out), ranks=2,
                    timeout=120)
        line = expect_one_error(r, f"its lock {tmp_path / '.merged.mpitailor-lock'} is held "
                                   f"by mpitailor clean (pid {clean.pid} on ")
        assert "); wait for it to end, or pick another output" in line, line
        assert not out.exists()
    finally:
        (gate / "go").touch()
    assert clean.wait(timeout=60) == 0, clean.communicate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate"]


def test_a_fifo_at_a_lock_path_is_never_taken_nor_removed(ckpt, tmp_path):
    """A FIFO where a merge's lock goes: the merge refuses it in one line and leaves it (a
    lock taken on it, the merge's end would have unlinked someone's FIFO)."""
    from mpitailor.publish.leftovers import take_lock
    out = tmp_path / "merged"
    fifo = tmp_path / ".merged.mpitailor-lock"
    os.mkfifo(fifo)
    r = run_cli([str(RECIPES / "parity.yml")], fixture_env(ckpt, out), ranks=2, timeout=120)
    expect_one_error(r, f"{fifo}: the lock path is not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and not out.exists()
    with pytest.raises(OSError) as e:
        take_lock(fifo)
    assert e.value.errno == errno.EINVAL and stat.S_ISFIFO(fifo.lstat().st_mode)


@pytest.mark.parametrize("case", ["symlink", "device"])
def test_stats_through_a_link_or_onto_a_device_is_refused_before_merging(ckpt, tmp_path,
                                                                         case):
    secret = tmp_path / "secret"
    secret.write_text("keep me\n")
    target = Path("/dev/full")
    if case == "symlink":
        target = tmp_path / "stats.json"
        target.symlink_to(secret)
    out = tmp_path / "out" / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--stats", str(target)],
                fixture_env(ckpt, out), ranks=2, timeout=120)
    expect_one_error(r, "a symbolic link (to " if case == "symlink" else
                     "not a regular file (a device, FIFO or socket)")
    assert not out.parent.exists() and secret.read_text() == "keep me\n"


def test_stats_that_cannot_be_written_says_the_merge_was_published(ckpt, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        with open(full / "filler", "wb") as f:  # the disk is full by the time stats come
            try:
                f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        out = tmp_path / "merged"
        r = run_cli([str(RECIPES / "parity.yml"), "--stats", str(full / "s.json")],
                    fixture_env(ckpt, out), ranks=2, timeout=120)
        no_traceback(r)
        expect_one_error(r, f"--stats {full / 's.json'}: not written (No space left on "
                            f"device); the merge itself was published to {out}", 1)
        assert f"mpitailor: merged 7 layers from 2 source(s) into {out}" in r.stdout
        assert (out / "global_step10").is_dir()
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # no half file, no tmp
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_stats_replaces_a_file_whole(ckpt, tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text("old")
    r = run_cli([str(RECIPES / "parity.yml"), "--stats", str(stats)],
                fixture_env(ckpt, tmp_path / "m"), ranks=2, timeout=120)
    assert r.returncode == 0 and not error_lines(r.stderr), r.stderr
    assert stats.read_text().startswith("{") and sorted(os.listdir(tmp_path)) == \
        ["m", "stats.json"]


# -- rough edges: max_host_bytes ------------------------------------------------------------

@pytest.mark.parametrize("value,message", [
    (-1, "-1 bytes is below the least accepted, 1 MiB (1048576)"),
    (1000, "1000 bytes is below the least accepted"),
    ("lots", "give a number of bytes or a size such as '2GB'"),
    (2.5e9, "give a number of bytes"),
    (True, "give a number of bytes")])
def test_max_host_bytes_that_is_not_a_size(value, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        host_bytes_limit(value)


def test_max_host_bytes_sizes():
    assert host_bytes_limit(None) is None
    assert host_bytes_limit("1GB") == 10**9 and host_bytes_limit("512MiB") == 512 << 20
    assert host_bytes_limit(1 << 20) == 1 << 20


def test_max_host_bytes_is_refused_when_the_checkpointer_is_made(tmp_path):
    from dataclasses import replace

    from ckpt_fixtures import spec_for

    from dev.tinytrain import launch
    from dev.tinytrain.launch import TrainFailed
    root = tmp_path / "run"
    spec = replace(spec_for("w2_parity_async", root), stats=None, max_host_bytes=-1)
    with pytest.raises(TrainFailed) as failed:
        launch(spec)
    text = str(failed.value)
    assert text.count("max_host_bytes=-1: -1 bytes is below the least accepted") >= 2
    assert "RuntimeError" not in text
    assert list(root.iterdir()) == []  # refused before the first save
