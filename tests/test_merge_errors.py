"""Bad input to the real CLI under mpiexec: one clear error line for the job (every rank
failed alike: rank 0 says it once, unprefixed), a non-zero exit, no hang, nothing published,
sources byte-identical."""
from __future__ import annotations

import pytest
from conftest import tree_digest
from merging import RECIPES, run_cli


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "mpitailor: error:" in line]


def expect_one_error(r, message: str, code: int = 2) -> str:
    """Every rank failed alike: the job says so in one line, rank 0's, with no rank prefix."""
    assert r.returncode == code, r.stderr
    errors = error_lines(r.stderr)
    assert len(errors) == 1 and errors[0].startswith("mpitailor: error: "), r.stderr
    assert message in errors[0], errors
    return errors[0]


def expect_clean_failure(r, out, *, sources, before, message: str):
    expect_one_error(r, message)
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*")), "staging or lock left behind"
    for root, digest in zip(sources, before):
        assert tree_digest(root) == digest


@pytest.fixture
def two_runs(ckpt_copy):
    """Private copies of a world-2 and a world-3 run (safe to damage)."""
    return ckpt_copy("w2_fp32_one"), ckpt_copy("w3_bf16_decay_tied_frozen")


def env(new, old, out):
    return {"NEW": str(new), "OLD": str(old), "OUT": str(out)}


CASES = {
    "missing source": lambda w2, w3: (w2 / "global_step99", w2 / "global_step5",
                                      "no such checkpoint"),
    "world sizes differ": lambda w2, w3: (w2 / "global_step10", w3 / "global_step5",
                                          "different world sizes"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_sources(two_runs, tmp_path, case):
    w2, w3 = two_runs
    new, old, message = CASES[case](w2, w3)
    before = [tree_digest(w2), tree_digest(w3)]
    out = tmp_path / "out" / "merged"
    r = run_cli([str(RECIPES / "parity.yml")], env(new, old, out), ranks=2)
    expect_clean_failure(r, out, sources=[w2, w3], before=before, message=message)


@pytest.mark.parametrize("damage", ["missing rank file", "truncated rank file"])
def test_damaged_rank_file_only_rank_1_reads(two_runs, tmp_path, damage):
    w2, _ = two_runs
    victim = w2 / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "missing rank file":
        victim.unlink()
        message = "missing zero_pp_rank_1_mp_rank_00_optim_states.pt"
    else:
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) * 2 // 3])
        message = "truncated"
    before = [tree_digest(w2)]
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml")],
                env(w2 / "global_step10", w2 / "global_step5", out), ranks=2)
    expect_clean_failure(r, out, sources=[w2], before=before, message=message)
    assert "(on rank 1)" in r.stderr, r.stderr  # the one line names the rank that saw it


RECIPE_ERRORS = {
    "gap": ("slices:\n- sources: [{model: '${NEW}', layer_range: [0, 1]}]\n"
            "- sources: [{model: '${OLD}', layer_range: [2, 4]}]\noutput: ${OUT}\n",
            "gap: layers 1-1 are in no slice"),
    "overlap": ("slices:\n- sources: [{model: '${NEW}', layer_range: [0, 3]}]\n"
                "- sources: [{model: '${OLD}', layer_range: [2, 4]}]\noutput: ${OUT}\n",
                "overlap: layers 2-2 are in two slices"),
    "uncovered": ("layers: {'0-2': '${NEW}'}\noutput: ${OUT}\n", "layers 3 have no source"),
    "twice": ("layers: {even: '${NEW}', '0-3': '${OLD}'}\noutput: ${OUT}\n",
              "layer 0 is chosen twice"),
    "unknown key": ("layers: {rest: '${NEW}'}\nlm_haed: '${OLD}'\noutput: ${OUT}\n",
                    "line 2: lm_haed: unknown key"),
    "output inside a source": ("layers: {rest: '${NEW}'}\noutput: ${NEW}/merged\n",
                               "overlaps source"),
    "blend": ("slices:\n- sources: [{model: '${NEW}', layer_range: [0, 4]},"
              " {model: '${OLD}', layer_range: [0, 4]}]\noutput: ${OUT}\n",
              "exactly one source"),
}


@pytest.mark.parametrize("case", list(RECIPE_ERRORS))
def test_bad_recipes(two_runs, tmp_path, case):
    w2, _ = two_runs
    text, message = RECIPE_ERRORS[case]
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(text)
    before = [tree_digest(w2)]
    out = tmp_path / "merged"
    r = run_cli([str(recipe)], env(w2 / "global_step10", w2 / "global_step5", out), ranks=2)
    if case == "output inside a source":
        out = w2 / "global_step10" / "merged"
    expect_clean_failure(r, out, sources=[w2], before=before, message=message)


def test_existing_output_is_never_overwritten(ckpt, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "precious").write_text("keep me")
    r = run_cli([str(RECIPES / "parity.yml")],
                env(ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5), out))
    assert r.returncode == 2 and "already exists" in r.stderr
    assert (out / "precious").read_text() == "keep me"


def test_each_rank_reads_little_more_than_it_writes(ckpt, tmp_path):
    """Byte counts, not timings: /proc/self/io read-call bytes of each rank's partition work
    stay under 1.2x the bytes it writes (one reader per byte, no whole-file loads)."""
    import json
    import socket
    stats = tmp_path / "stats.json"
    r = run_cli([str(RECIPES / "parity.yml"), "--stats", str(stats)],
                env(ckpt("w2_fp32_wide", 6), ckpt("w2_fp32_wide", 3), tmp_path / "merged"),
                ranks=2)
    assert r.returncode == 0, r.stderr
    ranks = json.loads(stats.read_text())["ranks"]
    assert [s["partitions"] for s in ranks] == [[0], [1]]
    assert [s["node"] for s in ranks] == [socket.gethostname()] * 2
    # every byte of the partition files counted once, by the rank that wrote it
    tag = next((tmp_path / "merged").glob("global_step*"))
    assert sum(s["bytes_written"] for s in ranks) == \
        sum(f.stat().st_size for f in tag.glob("*_states.pt"))
    for s in ranks:
        assert s["bytes_written"] > 0
        assert s["read_calls_bytes"] < 1.2 * s["bytes_written"], s


def test_whole_source_records_are_copied_unchanged(ckpt, tmp_path):
    """With one optimizer group per layer, a parity merge takes every flat buffer whole from
    one source: all of them are copied inside the kernel with the source's CRC, none through
    this process; with one group for the whole model, none can be."""
    import json

    from mpitailor.formats.zero.read import read_meta
    for name, whole in (("w4_fp32_per_layer", True), ("w2_fp32_one", False)):
        stats = tmp_path / f"{name}.json"
        new = ckpt(name, 10)
        r = run_cli([str(RECIPES / "parity.yml"), "--stats", str(stats)],
                    env(new, ckpt(name, 5), tmp_path / name), ranks=2)
        assert r.returncode == 0, r.stderr
        meta = read_meta(new)
        flat_bytes = sum(meta.layout.subgroup_sizes) * 12 * meta.world_size
        unchanged = sum(s["bytes_copied_unchanged"] for s in json.loads(stats.read_text())["ranks"])
        assert unchanged == (flat_bytes if whole else 0), (name, unchanged, flat_bytes)
