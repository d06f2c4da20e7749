"""The config and tokenizer files an HF export carries (`side files`), and the checks that
keep them what they claim to be: a config.json that is a JSON object, bounded in size; in a
dir the user names (`export --config DIR`), links followed only inside it or a Hugging
Face cache's blobs/; a warning when the config describes another model's shapes.
Torch-free; rank 0 only, all of it.
"""
from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import (
    MAX_CONFIG_BYTES,
    MAX_SIDE_FILE_BYTES,
    kind_of,
    loads,
    read_small,
    shown,
    too_large,
)
from mpitailor.formats.zero import MODEL_FILE, CheckpointMeta, extras_dir

log = logging.getLogger(__name__)


def side_files(side_dir: Path | None, config: Path | None = None) -> dict[str, Path]:
    """Rank 0 only. name -> the config and tokenizer files an HF export carries (the file to
    read): side_dir's, then `config`'s over them (`export --config`: a config.json, or a
    model dir whose side files replace the source's of the same names). Links in a save
    dir are not followed; in the dir a user names, only as far as given_dir_files allows."""
    found: dict[str, Path] = {}
    if side_dir is not None:
        found.update((p.name, p) for p in _model_files(side_dir) if not p.is_symlink())
    if config is not None and config.is_dir():
        found.update(given_dir_files(config))
    if config is not None and not config.is_dir():
        found["config.json"] = config  # named by the user: a link (Hub cache) is followed
    return found


NO_CONFIG_HINT = "fix it, or give the model's own config.json with `export --config`"


def has_config(base: CheckpointMeta, hint: str = NO_CONFIG_HINT) -> bool:
    """Rank 0 only. Does an HF export of `base` find a config.json beside it
    (`from_pretrained` needs one; a plain DeepSpeed save has none)? One that is there but
    is not a JSON object is an error naming it (hint: what to do)."""
    found = side_files(extras_dir(base)).get("config.json")
    if found is not None:
        read_config(found, hint, follow=False)
    return found is not None


def read_config(path: Path, hint: str, follow: bool) -> dict:
    """An HF config.json (a regular file, bounded, a JSON object); CheckpointError naming it,
    with `hint`, otherwise. follow: whether a link is followed (the user named it)."""
    try:
        doc = loads(read_small(path, MAX_CONFIG_BYTES, "an HF config.json", follow=follow))
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {hint}") from None
    except ValueError as e:  # not JSON, not UTF-8, nested too deep
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{shown(path)}: not a JSON object ({why}); {hint}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{shown(path)}: not a JSON object (a JSON "
                              f"{type(doc).__name__}), as a model's config.json is; {hint}")
    return doc


def given_dir_files(folder: Path) -> dict[str, Path]:
    """name -> the file to read, of the config and tokenizer files of a dir the user named
    (`export --config DIR`). A link is followed only to a regular file inside DIR or, if DIR
    is a Hugging Face cache snapshot (`snapshots/<rev>/`, links to `../../blobs/<hash>`),
    inside that cache's blobs/; any other link, and anything not a regular file, is refused
    naming it (a link to /etc/shadow must not end up in an export)."""
    root = Path(os.path.realpath(folder))
    roots = [root] + ([Path(os.path.realpath(root.parent.parent / "blobs"))]
                      if root.parent.name == "snapshots" else [])
    found = {}
    for p in sorted(folder.iterdir()):
        if not MODEL_FILE.fullmatch(p.name):
            continue
        target = Path(os.path.realpath(p))
        if p.is_symlink() and not any(target == r or r in target.parents for r in roots):
            raise CheckpointError(
                f"{shown(p)}: a link out of {shown(folder)} (to {shown(target)}); a model "
                f"dir's files are followed only inside it or a Hugging Face cache's blobs/: "
                f"copy the file there")
        try:
            st = os.stat(target, follow_symlinks=False)
        except OSError as e:
            raise CheckpointError(f"{shown(p)}: cannot read it ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{shown(p)}: {kind_of(st.st_mode)}, not a regular file; "
                                  f"a model's config and tokenizer files are regular files")
        limit = MAX_CONFIG_BYTES if p.name.endswith("config.json") else MAX_SIDE_FILE_BYTES
        if st.st_size > limit:
            raise too_large(p, st.st_size, limit, "a model's config or tokenizer file")
        found[p.name] = target
    return found


def _model_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if MODEL_FILE.fullmatch(p.name) and p.is_file())


_LAYER_NUMBER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def config_disagreements(config: dict, tensors: list[tuple[str, tuple[int, ...]]]
                         ) -> list[str]:
    """What an HF config.json says of the model's shapes that its parameters do not (a
    config of another model): ["hidden_size 4096 (the weights': 64)", ...]."""
    said: dict[str, int] = {}
    for name, shape in tensors:
        if name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")) \
                and len(shape) == 2:
            said.setdefault("vocab_size", shape[0])
            said.setdefault("hidden_size", shape[1])
        elif name.endswith("mlp.up_proj.weight") and len(shape) == 2:
            said.setdefault("intermediate_size", shape[0])
    layers = [int(m.group(1)) for name, _ in tensors if (m := _LAYER_NUMBER.search(name))]
    if layers:
        said["num_hidden_layers"] = max(layers) + 1
    return [f"{key} {config[key]} (the weights': {n})" for key, n in said.items()
            if isinstance(config.get(key), int) and config[key] != n]


def warn_if_another_model(path: Path, config: dict, tensors) -> None:
    wrong = config_disagreements(config, tensors)
    if wrong:
        log.warning("%s: a config.json of another model? It says %s; from_pretrained will not "
                    "load the export with it: give the model's own config.json", shown(path),
                    ", ".join(wrong))
