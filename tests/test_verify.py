"""`mpitailor verify PATH`: every file an output recorded read back against its record (size,
CRC-32), at any number of ranks; what differs named, one line each, exit 1; what no record
covers named as not verified; crafted manifests never make it read outside the output."""
from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from pathlib import Path

import pytest
from conftest import tree_digest
from merging import RECIPES, recipe_env, run_cli

from mpitailor.jobs.verify import _inside, _split


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """A parity merge of a real run with its HF export (partitions, model states, latest,
    extras, hf/): the output every test below damages a copy of."""
    from ckpt_fixtures import tag_dir
    out = tmp_path_factory.mktemp("verify") / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "hf", "--no-progress"],
                recipe_env(tag_dir("w2_fp32_one", 10), tag_dir("w2_fp32_one", 5), out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def copy(merged, tmp_path):
    dst = tmp_path / "merged"
    shutil.copytree(merged, dst, symlinks=True)
    return dst


def verify(path: Path, ranks: int = 1):
    return run_cli(["verify", str(path)], {}, ranks=ranks)


def differs(r) -> list[str]:
    return sorted(line.removeprefix("mpitailor: differs: ")
                  for line in r.stdout.splitlines() if line.startswith("mpitailor: differs: "))


def optim_file(out: Path) -> Path:
    return next(out.glob("global_step*/*optim_states.pt"))


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_merge_as_published_verifies_clean_and_is_not_modified(merged, ranks):
    before = tree_digest(merged)
    r = verify(merged, ranks)
    assert r.returncode == 0, r.stdout + r.stderr
    files = json.loads((merged / "mpitailor_manifest.json").read_text())["files"]
    assert f"verified {len(files)} file(s)" in r.stdout and "every file as recorded" in r.stdout
    assert tree_digest(merged) == before


DAMAGE = {
    # name -> (what it does to the output, the words the line must hold)
    "one bit flipped": (lambda f: _flip(f, f.stat().st_size // 2), "CRC-32"),
    "last byte flipped": (lambda f: _flip(f, f.stat().st_size - 1), "CRC-32"),
    "truncated": (lambda f: os.truncate(f, f.stat().st_size - 7), "recorded"),
    "grown": (lambda f: f.open("ab").write(b"\0"), "recorded"),
    "missing": (lambda f: f.unlink(), "missing"),
    "a link to the same bytes": (lambda f: _relink(f), "symbolic link"),
    "a fifo": (lambda f: (f.unlink(), os.mkfifo(f)), "not a regular file"),
    "a directory": (lambda f: (f.unlink(), f.mkdir()), "not a regular file"),
}


def _flip(f: Path, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0x10
    f.write_bytes(bytes(data))


def _relink(f: Path) -> None:
    keep = f.with_name(f.name + ".real")
    f.rename(keep)
    f.symlink_to(keep.name)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_to_any_recorded_file_is_named_at_every_rank_count(copy, case):
    """A damaged optimizer file (and, for the link, the file it points to, which the record
    does not name) is said in one line naming it, exit 1; the same lines at 1, 2 and 3
    ranks (a fifo never blocks a reader)."""
    damage, words = DAMAGE[case]
    target = optim_file(copy)
    damage(target)
    seen = []
    for ranks in (1, 2, 3):
        r = verify(copy, ranks)
        assert r.returncode == 1, r.stdout + r.stderr
        lines = differs(r)
        assert any(str(target) in line and words in line for line in lines), lines
        seen.append(lines)
    assert seen[0] == seen[1] == seen[2]


def test_a_file_the_record_does_not_name_differs(copy):
    (copy / "global_step10" / "zero_pp_rank_9_mp_rank_00_optim_states.pt").write_bytes(b"x")
    r = verify(copy)
    assert r.returncode == 1
    assert differs(r) == [f"{copy}/global_step10/zero_pp_rank_9_mp_rank_00_optim_states.pt: "
                          f"in the output but not in its mpitailor_manifest.json"]


@pytest.mark.parametrize("name", ["../outside", "/etc/hostname", "global_step10/../../outside",
                                  "a//b", "./latest", "", "a\\b", "x\0y", "lnk/secret"])
def test_a_crafted_record_never_reads_outside_the_output(copy, tmp_path, name):
    """A manifest naming a file outside the output (or through a link in it) is a difference
    in one line; the file outside is never read (its record would match if it were)."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    (copy / "lnk").symlink_to(tmp_path)
    (tmp_path / "secret").write_bytes(b"secret")
    path = copy / "mpitailor_manifest.json"
    doc = json.loads(path.read_text())
    doc["files"][name] = {"bytes": 6, "crc32": "4c14ccb8"}  # crc32(b"secret")
    doc["files"]["lnk"] = {"bytes": 0, "crc32": "00000000"}
    path.write_text(json.dumps(doc))
    r = verify(copy)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = differs(r)
    assert any("not a plain path inside the output" in line for line in lines), lines
    assert not any("secret" in line and "CRC" in line for line in lines)


def test_records_of_the_wrong_shape_are_differences(copy):
    path = copy / "mpitailor_manifest.json"
    doc = json.loads(path.read_text())
    name = next(iter(doc["files"]))
    doc["files"][name] = {"bytes": -1, "crc32": "zz"}
    path.write_text(json.dumps(doc))
    r = verify(copy, 2)
    assert r.returncode == 1
    assert any(name in line and "is not {bytes, crc32}" in line for line in differs(r))


def test_a_save_dir_verifies_its_partial_and_full_saves(ckpt_copy):
    """A layer-wise run's save dir: every save checked (a partial save's manifest and a full
    save's record list their files); a bit flipped in a partial save's slice file is found."""
    run = ckpt_copy("w2_parity")
    r = verify(run, 2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of 4 output(s)" in r.stdout and "global_step2: a full save" not in r.stdout
    target = run / "global_step6" / "rank_1_layers.safetensors"
    _flip(target, target.stat().st_size - 3)
    r = verify(run, 2)
    assert r.returncode == 1
    assert differs(r) == [f"{target}: CRC-32" + differs(r)[0].split("CRC-32", 1)[1]]


# -- full saves through the checkpointers: DeepSpeed's files recorded in mpitailor_save.json


@pytest.mark.parametrize("name,step", [("w2_parity", 2), ("s1_w2_parity", 2),
                                       ("s2_w3_bf16_parity", 2), ("hf_w2_parity", 2)])
def test_a_full_save_records_every_file_deepspeed_wrote_as_it_is_on_disk(name, step):
    from ckpt_fixtures import HF_MODULE, VARIANTS, tag_dir
    tag = tag_dir(name, step)
    if VARIANTS[name][1] == HF_MODULE:
        tag = tag / f"global_step{step}"
    record = json.loads((tag / "mpitailor_save.json").read_text())
    on_disk = {p.name for p in tag.iterdir()} - {"mpitailor_save.json"}
    assert set(record["files"]) == on_disk and any("optim_states" in n for n in on_disk)
    for n, rec in record["files"].items():
        data = (tag / n).read_bytes()
        assert rec == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, n


def test_verify_checks_a_full_save_against_its_record(ckpt_copy):
    run = ckpt_copy("w2_parity")
    full = run / "global_step2"
    r = verify(full, 2)
    assert r.returncode == 0 and "verified 4 file(s)" in r.stdout, r.stdout + r.stderr
    optim = full / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip(optim, optim.stat().st_size // 2)
    (full / "stray.pt").write_bytes(b"x")
    model = full / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model.write_bytes(model.read_bytes()[:-1])
    r = verify(run, 3)
    assert r.returncode == 1
    assert [d.split(": ", 1)[0] for d in differs(r)] == sorted(map(str, (full / "stray.pt",
                                                                         optim, model)))
    assert any("bytes," in d and "recorded" in d for d in differs(r))


def test_a_full_save_whose_record_lists_no_files_is_named_not_verified(ckpt_copy):
    run = ckpt_copy("w2_parity")
    record = run / "global_step2" / "mpitailor_save.json"
    doc = json.loads(record.read_text())
    del doc["files"]
    record.write_text(json.dumps(doc))
    r = verify(run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"not verified: {run}/global_step2: a full save, its mpitailor_save.json records " \
           f"no files" in r.stdout
    record.write_text(json.dumps({**doc, "files": ["x"]}))
    r = verify(run)
    assert r.returncode == 1 and "unreadable save record (files is not a mapping)" in r.stdout


@pytest.mark.parametrize("recorded", [True, False])
def test_recover_verify_checks_a_full_save_whole_against_its_record(ckpt_copy, tmp_path,
                                                                     recorded):
    """With a record, recover --verify checks the full save's files whole: a byte anywhere
    in them. Without one (DeepSpeed's own save) it checks the zip records the composite
    reads, and this byte lies in a sub-group's buffer that a later partial save holds."""
    run = ckpt_copy("w2_parity")
    for later in ("global_step6", "global_step8"):  # so that the full save is a source
        shutil.rmtree(run / later)
    full = run / "global_step2"
    if not recorded:
        record = full / "mpitailor_save.json"
        doc = json.loads(record.read_text())
        del doc["files"]
        record.write_text(json.dumps(doc))
    optim = full / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip(optim, optim.stat().st_size // 2)
    r = run_cli(["recover", str(run), "-o", str(tmp_path / "out"), "--verify", "-q"], {})
    if not recorded:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode != 0 and not (tmp_path / "out").exists()
    assert f"{optim}: fails the CRC-32 its full save recorded" in r.stderr, r.stderr


def test_a_staging_dir_is_named_not_verified(copy, tmp_path):
    (tmp_path / ".merged.mpitailor-staging").mkdir()
    r = verify(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "staging dir" in r.stdout and "of 1 output(s)" in r.stdout


@pytest.mark.parametrize("what", ["not a dir", "no outputs"])
def test_nothing_to_verify_is_one_line_exit_2(tmp_path, what):
    path = tmp_path / "f"
    if what == "not a dir":
        path.write_text("x")
    else:
        path.mkdir()
    for ranks in (1, 2):
        r = verify(path, ranks)
        assert r.returncode == 2
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and str(path) in errors[0], r.stderr


@pytest.mark.parametrize("seed", range(30))
def test_the_work_split_reads_every_recorded_byte_once(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, 4096, rng.randint(0, 10**7)]) for _ in range(rng.randint(1, 30))]
    for ranks in (1, 2, 3, rng.randint(4, 70)):
        work = _split(sizes, ranks)
        seen: dict[int, list[tuple[int, int]]] = {}
        for tasks in work:
            for i, lo, hi in tasks:
                seen.setdefault(i, []).append((lo, hi))
        for i, n in enumerate(sizes):
            spans = sorted(seen[i])  # every file, even of 0 bytes, is opened by some rank
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        loads = [sum(hi - lo for _, lo, hi in tasks) for tasks in work]
        assert max(loads) - min(loads) <= 1


NAME_PARTS = ["a", "b", "..", ".", "", "/", "\\", "\0", "lnk", "ok.pt", "~", " "]


@pytest.mark.parametrize("seed", range(20))
def test_no_recorded_name_leads_outside_the_output(tmp_path, seed):
    """Property: for any name a manifest may hold, _inside gives None or a path that lies
    inside the output once resolved (no `..`, no absolute path, no link on the way)."""
    out = tmp_path / "out"
    (out / "a").mkdir(parents=True)
    (out / "lnk").symlink_to(tmp_path)
    rng = random.Random(seed)
    for _ in range(300):
        name = "".join(rng.choice(NAME_PARTS) + rng.choice(["/", ""])
                       for _ in range(rng.randint(1, 6)))
        where = _inside(out, name)
        if where is not None:  # its last part is opened with O_NOFOLLOW: its folder counts
            folder = Path(os.path.realpath(where.parent))
            assert folder.is_relative_to(os.path.realpath(out)), name
            assert where.name not in ("", ".", ".."), name


# -- what an attack on it found (a helper's hour, issue 44): each now one line, never a
# traceback, never a silent pass --------------------------------------------------------


def test_a_partial_save_without_its_manifest_is_named_not_verified(ckpt_copy):
    run = ckpt_copy("w2_parity")
    (run / "global_step4" / "mpitailor_partial.json").unlink()
    r = verify(run, 2)
    assert f"not verified: {run}/global_step4: 10 entries no record covers (" in r.stdout
    assert f"not verified: {run}: 5 entries no record covers (DONE, latest, stats.h5" \
        in r.stdout
    assert "not verified (no record covers them)" in r.stdout


def test_a_damaged_manifest_is_a_difference_and_the_other_outputs_are_still_checked(
        merged, tmp_path):
    for name in ("good", "bad"):
        shutil.copytree(merged, tmp_path / name)
    (tmp_path / "bad" / "mpitailor_manifest.json").write_text("{not json")
    r = verify(tmp_path, 2)
    assert r.returncode == 1, r.stdout + r.stderr
    assert len(differs(r)) == 1 and "bad/mpitailor_manifest.json" in differs(r)[0]
    assert "of 2 output(s)" in r.stdout


CRAFTED = {
    "a part over 255 bytes": lambda d: d["files"].update({"x" * 300 + "/y": _rec()}),
    "a lone surrogate": lambda d: d["files"].update({"lat\ud800est": d["files"].pop("latest")}),
    "a size past 2**63": lambda d: d["files"]["latest"].update(bytes=10**400),
    "a crc with 0x": lambda d: d["files"]["latest"].update(crc32="0x" + d["files"]["latest"]["crc32"]),
    "node_local naming no node": lambda d: d.update(node_local={"node": "z", "files_of_node": {}}),
    "node_local of ints": lambda d: d.update(node_local={"node": [1], "files_of_node": {"a": 3}}),
}


def _rec():
    return {"bytes": 1, "crc32": "00000000"}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_manifest_fields_are_differences_in_one_line(copy, case):
    path = copy / "mpitailor_manifest.json"
    doc = json.loads(path.read_text())
    CRAFTED[case](doc)
    path.write_text(json.dumps(doc))
    for ranks in (1, 3):
        r = verify(copy, ranks)
        assert r.returncode == 1 and not r.stderr.strip(), r.stdout + r.stderr
        assert differs(r) and all(len(line) < 400 for line in differs(r)), differs(r)


def test_a_tree_of_a_thousand_folders_is_walked_without_recursion(copy):
    """A recorded file 1000 folders down (checked), an unrecorded one beside it (named), an
    empty folder no recorded name passes through (named, not walked)."""
    import zlib
    folder = copy
    for _ in range(1000):
        folder = folder / "d"
        folder.mkdir()
    (folder / "rec").write_bytes(b"deep")
    (folder / "extra").write_bytes(b"x")
    (copy / "empty" / "inside").mkdir(parents=True)
    path = copy / "mpitailor_manifest.json"
    doc = json.loads(path.read_text())
    doc["files"]["d/" * 1000 + "rec"] = {"bytes": 4, "crc32": f"{zlib.crc32(b'deep'):08x}"}
    path.write_text(json.dumps(doc))
    try:
        r = verify(copy)
        assert r.returncode == 1 and not r.stderr.strip(), r.stderr[-500:]
        assert differs(r) == sorted([f"{copy}/empty: a folder that holds no recorded file",
                                     f"{folder}/extra: in the output but not in its "
                                     f"mpitailor_manifest.json"])
    finally:  # bottom up: pytest's clean-up (a recursive rmtree) would hit the limit
        for f in folder.iterdir():
            f.unlink()
        while folder != copy:
            folder.rmdir()
            folder = folder.parent


def test_a_link_to_a_folder_in_the_output_is_an_unrecorded_entry(copy, tmp_path):
    (copy / "elsewhere").symlink_to(tmp_path)
    r = verify(copy)
    assert r.returncode == 1
    assert differs(r) == [f"{copy}/elsewhere: in the output but not in its "
                          f"mpitailor_manifest.json"]


def test_ranks_that_see_other_files_than_rank_0_refuse(merged):
    """Node-local disks: rank 0's survey (inode, size, times of PATH and each record) must be
    what every rank sees, else one line and exit 2, never a verdict of mixed copies."""
    from mpitailor.errors import UserError
    from mpitailor.jobs.verify import _ident, _same_view

    class Rank1:
        rank = 1
    seen = {str(merged): _ident(merged)}
    _same_view(Rank1(), merged, seen)  # the same view: nothing said
    seen[str(merged / "mpitailor_manifest.json")] = (1, 2, 3, 4)
    with pytest.raises(UserError, match="rank 1 sees other files there than rank 0"):
        _same_view(Rank1(), merged, seen)


def test_records_and_leftovers_of_a_save_dir_are_told_apart(ckpt_copy, merged):
    """In a save dir: the in-job resume's composites (.mpitailor-resume/) are outputs and
    verified; prune's tombstones are named for what they are; a staging dir as one; an HF
    checkpoint's own files and a dir past the depth are named, never passed silently."""
    run = ckpt_copy("w2_parity")
    resume = run / ".mpitailor-resume" / "recovered-global_step8-w2"
    shutil.copytree(merged, resume)
    _flip(optim_file(resume), 100)
    (run / ".mpitailor-pruned").mkdir()
    (run / ".global_step9.mpitailor-staging").mkdir()
    (run / "checkpoint-9" / "a" / "b").mkdir(parents=True)
    (run / "checkpoint-9" / "trainer_state.json").write_text("{}")
    r = verify(run, 2)
    assert r.returncode == 1
    assert [line.split(":")[0] for line in differs(r)] == [str(optim_file(resume))]
    out = r.stdout
    assert f"{run}/.mpitailor-pruned: the tombstones of pruned saves" in out
    assert f"{run}/.global_step9.mpitailor-staging: a staging dir" in out
    assert f"{run}/checkpoint-9: 1 entry no record covers (trainer_state.json)" in out
    assert f"{run}/checkpoint-9/a/b: not searched (deeper than 2 levels" in out


def test_a_manifest_that_records_no_file_differs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mpitailor_manifest.json").write_text(
        json.dumps({"format_version": "1.1", "kind": "merge", "files": {}}))
    r = verify(out)
    assert r.returncode == 1 and "records no file" in r.stdout


def _recover_from_full_save(run: Path, out: Path, *extra: str):
    for later in ("global_step6", "global_step8"):  # so that the full save is a source
        shutil.rmtree(run / later, ignore_errors=True)
    return run_cli(["recover", str(run), "-o", str(out), "-q", *extra], {})


def test_a_full_saves_recorded_sizes_are_checked_even_without_verify(ckpt_copy, tmp_path):
    run = ckpt_copy("w2_parity")
    optim = run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(optim, "ab") as f:
        f.write(bytes(100))
    r = _recover_from_full_save(run, tmp_path / "out")
    assert r.returncode != 0 and not (tmp_path / "out").exists()
    assert f"{optim}: {optim.stat().st_size} bytes, but the full save wrote" in r.stderr, \
        r.stderr


@pytest.mark.parametrize("entry", ["x", {"bytes": 3}, {"bytes": 1, "crc32": "ABCDEF12"}])
def test_a_damaged_record_entry_is_refused_by_verify_not_checked_less(ckpt_copy, tmp_path,
                                                                      entry):
    run = ckpt_copy("w2_parity")
    record = run / "global_step2" / "mpitailor_save.json"
    doc = json.loads(record.read_text())
    doc["files"]["zero_pp_rank_0_mp_rank_00_model_states.pt"] = entry
    record.write_text(json.dumps(doc))
    r = _recover_from_full_save(run, tmp_path / "out", "--verify")
    assert r.returncode != 0 and not (tmp_path / "out").exists()
    assert "no record of zero_pp_rank_0_mp_rank_00_model_states.pt as {bytes, crc32}" \
        in r.stderr, r.stderr
