"""Untrusted files stay bounded, typed and inside their directory (issue 32, A1).

Every file mpitailor reads as metadata (manifests, save records, `latest`, config.json,
safetensors headers, side files) comes with the checkpoint: a FIFO there must not hang a
job, a link to /dev/zero must not eat its memory, JSON nested thousands deep must not
escape as a RecursionError, and `export --config DIR` must not copy what a link of DIR
points to outside it. Each case is a real DeepSpeed save, damaged, and the real CLI with a
timeout (a hang fails the test instead of CI).
"""
from __future__ import annotations

import json
import os
import zlib

import pytest
from ckpt_fixtures import build
from merging import RECIPES, run_cli
from test_merge_errors import error_lines, expect_one_error

from mpitailor.errors import CheckpointError
from mpitailor.formats.io.boundedio import MAX_JSON_DEPTH, loads, read_small, shown
from mpitailor.formats.io.fsview import UnionView, listing

TIMEOUT = 120
DEEP = b"[" * 100_000 + b"]" * 100_000   # json.loads: RecursionError near 1000
SECRET = "TOPSECRET-3f9a"


def plant(path, kind: str, tmp_path) -> str:
    """Put `kind` where the file `path` was; the words the refusal should use."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO (named pipe), not a regular file"
    if kind == "dev_zero":
        path.symlink_to("/dev/zero")
        return "a symbolic link, not a regular file"
    if kind == "deep":
        path.write_bytes(DEEP)
        return f"nested deeper than {MAX_JSON_DEPTH} levels"
    if kind == "secret_link":
        secret = tmp_path / "secret"
        secret.write_text(f"{SECRET}\n")
        path.symlink_to(secret)
        return "a symbolic link, not a regular file"
    raise ValueError(kind)


def cli(args, ranks: int = 1):
    return run_cli([str(a) for a in args], {}, ranks=ranks, timeout=TIMEOUT)


def no_traceback(r) -> None:
    assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr, r.stderr
    assert "MemoryError" not in r.stderr, r.stderr


# -- 1, 3: a partial save's manifest that is a FIFO, a link to /dev/zero, or deep JSON ------

def test_recover_skips_a_partial_save_whose_manifest_is_not_one(ckpt_copy, tmp_path):
    """Deep JSON: damaged by its own bytes. recover skips that save, says why, and recovers
    from the saves before it."""
    root = ckpt_copy("w2_parity")  # full save at 2, partial saves at 4, 6, 8
    why = plant(root / "global_step8" / "mpitailor_partial.json", "deep", tmp_path)
    out = tmp_path / "out"
    r = cli(["recover", root, "-o", out])
    assert r.returncode == 0, r.stderr
    no_traceback(r)
    skipped = [line for line in r.stderr.splitlines() if "skipping global_step8" in line]
    assert skipped and why in skipped[0] and "mpitailor_partial.json" in skipped[0], r.stderr
    assert (out / "latest").read_text() == "global_step6"


@pytest.mark.parametrize("kind,ranks", [("fifo", 2), ("dev_zero", 1)])
def test_recover_refuses_a_partial_save_whose_manifest_cannot_be_read(ckpt_copy, tmp_path,
                                                                      kind, ranks):
    """A FIFO or a link where the manifest should be: not read (no hang), and not taken for
    an incomplete save either: the save cannot be read now, and it holds the newest copy of
    some layers, so recover refuses (exit 1) rather than take older ones (issue 40)."""
    root = ckpt_copy("w2_parity")
    why = plant(root / "global_step8" / "mpitailor_partial.json", kind, tmp_path)
    out = tmp_path / "out"
    r = cli(["recover", root, "-o", out], ranks=ranks)
    line = expect_one_error(r, why, code=1)
    assert f"{root / 'global_step8'}: cannot be read now" in line, line
    no_traceback(r)
    assert not out.exists()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep"])
def test_inspect_refuses_a_manifest_that_is_not_one(ckpt_copy, tmp_path, kind):
    root = ckpt_copy("w2_parity")
    manifest = root / "global_step8" / "mpitailor_partial.json"
    why = plant(manifest, kind, tmp_path)
    r = cli(["inspect", root / "global_step8"])
    line = expect_one_error(r, why)
    assert str(manifest) in line
    no_traceback(r)


def test_export_of_the_save_dir_leaves_that_save_out(ckpt_copy, tmp_path):
    root = ckpt_copy("w2_parity")
    plant(root / "global_step8" / "mpitailor_partial.json", "deep", tmp_path)
    out = tmp_path / "fp32"
    r = cli(["export", root, "-o", out, "--format", "fp32"], ranks=2)
    assert r.returncode == 0, r.stderr
    assert "skipping global_step8" in r.stderr and "nested deeper" in r.stderr, r.stderr
    manifest = json.loads((out / "mpitailor_manifest.json").read_text())
    steps = {s["global_steps"] for s in manifest["sources"].values()}
    assert max(steps) == 6, manifest["sources"]


# -- a full save's record that is not one is unreadable, not absent -------------------------

@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep"])
def test_an_unreadable_save_record_is_reported_not_taken_as_none(ckpt_copy, tmp_path, kind):
    """Taken as "no record", the one full save would make every partial save after it
    "another timeline", and recover would return step 2 as if nothing were wrong."""
    root = ckpt_copy("w2_parity")
    why = plant(root / "global_step2" / "mpitailor_save.json", kind, tmp_path)
    r = cli(["recover", root, "-o", tmp_path / "out"])
    # deep JSON is damaged (no usable full save: exit 2); a FIFO or a link where the record
    # should be cannot be read now (exit 1: it may be the parent of the saves after it)
    line = expect_one_error(r, "no usable full checkpoint" if kind == "deep" else
                            "global_step2 (", code=2 if kind == "deep" else 1)
    assert "global_step2" in line and why in line and "mpitailor_save.json" in line, line
    assert "another timeline" not in r.stderr
    assert not (tmp_path / "out").exists()
    no_traceback(r)


def test_a_deep_save_record_of_the_newest_full_save_is_skipped(ckpt_copy, tmp_path):
    root = ckpt_copy("w2_parity_twin_full")  # full saves at 2, 4, 6, 8
    plant(root / "global_step8" / "mpitailor_save.json", "deep", tmp_path)
    out = tmp_path / "out"
    r = cli(["recover", root, "-o", out], ranks=2)
    assert r.returncode == 0, r.stderr
    assert "skipping global_step8" in r.stderr and "nested deeper" in r.stderr, r.stderr
    assert (out / "latest").read_text() == "global_step6"


# -- `latest`: a small regular file, whose content is never echoed --------------------------

@pytest.mark.parametrize("kind", ["secret_link", "fifo", "binary"])
def test_latest_that_is_not_a_tag_name_is_refused_without_echoing_it(ckpt_copy, tmp_path,
                                                                     kind):
    root = ckpt_copy("w2_fp32_one")
    latest = root / "latest"
    if kind == "binary":
        latest.write_bytes(f"{SECRET}\x1b[2J\n".encode())
        why = "does not name a tag dir"
    else:
        why = plant(latest, kind, tmp_path)
    r = cli(["inspect", root])
    line = expect_one_error(r, why)
    assert str(latest) in line
    assert SECRET not in r.stderr + r.stdout


# -- 3: deep JSON in a safetensors header, a merge manifest --------------------------------

def test_a_partial_layers_file_with_a_deep_header_is_skipped(ckpt_copy, tmp_path):
    """Its manifest's size and CRC-32 forged to match: the header itself must be refused."""
    root = ckpt_copy("w2_parity")
    tag = root / "global_step8"
    layers = tag / "rank_1_layers.safetensors"
    header = b"[" * 5000 + b"]" * 5000
    data = len(header).to_bytes(8, "little") + header
    layers.write_bytes(data)
    manifest = json.loads((tag / "mpitailor_partial.json").read_text())
    manifest["files"][layers.name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (tag / "mpitailor_partial.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    r = cli(["recover", root, "-o", out], ranks=2)
    no_traceback(r)
    assert str(layers) in r.stderr and "nested deeper" in r.stderr, r.stderr
    assert r.returncode == 2 and not out.exists() or \
        (r.returncode == 0 and (out / "latest").read_text() == "global_step6"), r.stderr


def test_inspect_refuses_a_deep_merge_manifest(ckpt_copy, tmp_path):
    root = ckpt_copy("w2_fp32_one")
    (root / "mpitailor_manifest.json").write_bytes(DEEP)
    r = cli(["inspect", root])
    line = expect_one_error(r, "nested deeper")
    assert str(root / "mpitailor_manifest.json") in line
    no_traceback(r)


# -- 4: an HF checkpoint's own config.json that is not one --------------------------------

@pytest.fixture
def hf_save(ckpt_copy):
    return ckpt_copy("hf_w2_bf16") / "checkpoint-10"


@pytest.mark.parametrize("content", [b"garbage{", b"[]", DEEP])
def test_export_refuses_a_bad_config_json_of_the_checkpoint(hf_save, tmp_path, content):
    (hf_save / "config.json").write_bytes(content)
    out = tmp_path / "hf"
    r = cli(["export", hf_save, "-o", out])
    line = expect_one_error(r, f"{hf_save / 'config.json'}: not a JSON object")
    assert "--config" in line
    assert not out.exists()
    no_traceback(r)


def test_merge_export_hf_refuses_a_bad_config_json(hf_save, tmp_path):
    (hf_save / "config.json").write_text("garbage{")
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "hf"],
                {"NEW": str(hf_save), "OLD": str(hf_save), "OUT": str(out)}, ranks=2,
                timeout=TIMEOUT)
    line = expect_one_error(r, f"{hf_save / 'config.json'}: not a JSON object")
    assert "--config" in line and not out.exists()


def test_export_with_config_does_not_read_the_bad_one(hf_save, tmp_path):
    good = json.loads((hf_save / "config.json").read_text())
    (hf_save / "config.json").write_text("garbage{")
    given = tmp_path / "config.json"
    given.write_text(json.dumps(good))
    out = tmp_path / "hf"
    r = cli(["export", hf_save, "-o", out, "--config", given])
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["hidden_size"] == good["hidden_size"]


# -- 7: export --config DIR: links stay inside, sizes bounded, types said ------------------

@pytest.fixture
def model_dir(tmp_path):
    """A model dir with the tiny model's own config.json (that of hf_w2_bf16)."""
    d = tmp_path / "model"
    d.mkdir()
    own = build("hf_w2_bf16") / "checkpoint-10" / "config.json"
    (d / "config.json").write_bytes(own.read_bytes())
    return d


def export_with(config, tmp_path, ranks=1):
    out = tmp_path / "hf"
    save = build("hf_w2_bf16") / "checkpoint-10"
    return cli(["export", save, "-o", out, "--config", config], ranks=ranks), out


@pytest.mark.parametrize("name,target", [("vocab.txt", "secret"),
                                         ("special_tokens_map.json", "/proc/self/environ"),
                                         ("tokenizer.json", "../model2/tokenizer.json")])
def test_config_dir_links_out_of_it_are_refused(model_dir, tmp_path, name, target):
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "model2").mkdir()
    (tmp_path / "model2" / "tokenizer.json").write_text(json.dumps({"k": SECRET}))
    link = model_dir / name
    link.symlink_to(tmp_path / target if target == "secret" else target)
    r, out = export_with(model_dir, tmp_path, ranks=2)
    line = expect_one_error(r, f"--config {link}: a link out of {model_dir}")
    assert SECRET not in r.stderr and not out.exists(), line


def test_config_dir_of_a_hub_cache_snapshot_follows_its_blob_links(model_dir, tmp_path):
    """HF's cache: snapshots/<rev>/file -> ../../blobs/<hash>; links within the dir too."""
    cache = tmp_path / "models--tiny"
    snap, blobs = cache / "snapshots" / "abc123", cache / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for name, text in (("config.json", (model_dir / "config.json").read_text()),
                       ("tokenizer_config.json", '{"model_max_length": 64}')):
        (blobs / f"h-{name}").write_text(text)
        (snap / name).symlink_to(f"../../blobs/h-{name}")
    (snap / "vocab.json").write_text('{"a": 0}')
    (snap / "special_tokens_map.json").symlink_to("vocab.json")  # inside the dir
    r, out = export_with(snap, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert (out / "special_tokens_map.json").read_text() == '{"a": 0}'
    assert not (out / "tokenizer_config.json").is_symlink()


@pytest.mark.parametrize("kind,why", [("fifo", "a FIFO (named pipe), not a regular file"),
                                      ("dev_zero", "a character device, not a regular file"),
                                      ("deep", "nested deeper than")])
def test_config_that_is_not_a_file_says_what_it_is(tmp_path, kind, why):
    config = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "deep":
        config.write_bytes(DEEP)
    else:
        config = "/dev/zero"
    r, out = export_with(config, tmp_path)
    line = expect_one_error(r, f"--config {config}: ")
    assert why in line and "directory without" not in line, line
    assert not out.exists()


def test_config_dir_with_a_fifo_side_file_is_refused(model_dir, tmp_path):
    os.mkfifo(model_dir / "tokenizer.json")
    r, out = export_with(model_dir, tmp_path)
    expect_one_error(r, f"{model_dir / 'tokenizer.json'}: a FIFO (named pipe)")


def test_config_dir_side_files_are_bounded(model_dir, tmp_path):
    big = model_dir / "tokenizer.json"
    with open(big, "wb") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB that take no disk
    r, out = export_with(model_dir, tmp_path)
    line = expect_one_error(r, f"{big}: {65 << 20} bytes, larger than")
    assert "64 MiB" in line and not out.exists()


def test_a_config_of_another_model_is_warned_about(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(hidden_size=4096, num_hidden_layers=32)
    (model_dir / "config.json").write_text(json.dumps(config))
    r, out = export_with(model_dir, tmp_path)
    assert r.returncode == 0, r.stderr
    warning = [line for line in r.stderr.splitlines() if "of another model" in line]
    assert len(warning) == 1, r.stderr
    assert "hidden_size 4096" in warning[0] and "num_hidden_layers 32" in warning[0]
    r, _ = export_with(build("hf_w2_bf16") / "checkpoint-10" / "config.json", tmp_path / "b")
    assert r.returncode == 0 and "of another model" not in r.stderr, r.stderr


# -- the reader itself ----------------------------------------------------------------------

def test_read_small_refuses_without_blocking_or_reading_on(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="a FIFO"):
        read_small(fifo, 1 << 20, "a manifest")
    with pytest.raises(CheckpointError, match="a character device"):
        read_small("/dev/zero", 1 << 20, "a manifest", follow=True)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(CheckpointError, match="101 bytes, larger than a manifest ever is"):
        read_small(tmp_path / "big", 100, "a manifest")
    assert read_small(tmp_path / "big", 101, "a manifest") == b"x" * 101
    with pytest.raises(ValueError, match="nested deeper"):
        loads(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    assert loads(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is not None
    assert "\n" not in shown(tmp_path / "a\nmpitailor: error: forged")


def test_a_job_listing_never_opens_a_fifo(tmp_path):
    """Node-local storage: each node lists its files; a FIFO is described, not opened."""
    (tmp_path / "tag").mkdir()
    os.mkfifo(tmp_path / "tag" / "mpitailor_partial.json")
    (tmp_path / "tag" / "latest").write_text("global_step2")
    view = UnionView(listing(tmp_path))
    assert view.read_bytes(tmp_path / "tag" / "latest", 300) == b"global_step2"
    with pytest.raises(CheckpointError, match="a FIFO"):
        view.read_bytes(tmp_path / "tag" / "mpitailor_partial.json")
    assert not view.is_file(tmp_path / "tag" / "mpitailor_partial.json")


def test_error_lines_helper_sees_one_line(tmp_path):
    """A crafted file name cannot add lines of its own to an error (names are escaped)."""
    root = tmp_path / "run\nmpitailor: error: forged"
    root.mkdir()
    (root / "latest").symlink_to("/dev/zero")
    r = cli(["inspect", root])
    assert len(error_lines(r.stderr)) == 1, r.stderr


# -- the lead's sweep of what the review listed around the readers -------------------------

def test_a_recipe_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    recipe = tmp_path / "recipe.yml"
    os.mkfifo(recipe)
    r = cli([recipe, "-o", tmp_path / "out"])
    expect_one_error(r, "a FIFO (named pipe), not a regular file")
    no_traceback(r)
    assert not (tmp_path / "out").exists()


def test_a_latest_that_is_a_fifo_is_said_and_recovery_goes_on(ckpt_copy, tmp_path):
    """The save dir's `latest` a FIFO: not read (no hang), said in a warning, and recovery
    starts from the newest complete full save as it does without one."""
    root = ckpt_copy("w2_parity")
    plant(root / "latest", "fifo", tmp_path)
    r = cli(["recover", root, "-o", tmp_path / "out"])
    assert r.returncode == 0, r.stderr
    assert "a FIFO (named pipe), not a regular file" in r.stderr, r.stderr
    no_traceback(r)


def test_a_tombstone_of_deep_json_no_save_needs_is_skipped_naming_it(ckpt_copy, tmp_path):
    """No save builds on it: a warning naming it, and recovery goes on (issue 40, R5; one
    that a save builds on is an error: tests/test_retention_safety.py)."""
    root = ckpt_copy("w2_parity")
    (root / ".mpitailor-pruned").mkdir()
    (root / ".mpitailor-pruned" / ("ab" * 16)).write_bytes(DEEP)
    r = cli(["recover", root, "-o", tmp_path / "out"])
    assert r.returncode == 0, r.stderr
    assert f"ignoring {root / '.mpitailor-pruned' / ('ab' * 16)}: not a tombstone" in r.stderr
    no_traceback(r)
