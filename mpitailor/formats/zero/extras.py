"""The files around a ZeRO-3 tag dir that a resume also needs (carried into the output).

From the base source's save dir (an HF `checkpoint-N/`, an `accelerator.save_state` dir or
a DeepSpeed save dir): trainer state, rng states, scheduler, training args, config,
generation config, tokenizer files, `zero_to_fp32.py`, Accelerate's own files -- known names
only. HF's torch files among them are safe-loaded first, so one carrying a pickle payload is
refused rather than passed on. Accelerate's files are copied as bytes, never loaded, as
`training_args.bin` is: they are pickles of whatever the loop registered (custom objects,
samplers), which only the resuming script, trusting its own save, unpickles. 16-bit weight
files are not copied: they hold the base's weights, not the merged ones: the merge rebuilds
safetensors weights (engine/hf_weights.py) and leaves `.bin` ones out, with a warning.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import MAX_SIDE_FILE_BYTES, open_regular, read_bounded
from mpitailor.formats.manifest import MANIFEST
from mpitailor.formats.torch import load
from mpitailor.formats.zero.files import LATEST, LATEST_UNIVERSAL, read_latest
from mpitailor.formats.zero.meta import CheckpointMeta

log = logging.getLogger(__name__)

WEIGHT_FILE = re.compile(r"(model|pytorch_model|adapter_model)([-.].*)?\.(safetensors|bin)"
                         r"(\.index\.json)?")
# What a checkpoint is made of besides its tag dir: DeepSpeed's scripts; HF Trainer's state,
# rng, scheduler and args; the model's config and tokenizer. Anything else in a save dir
# (logs, core dumps, a user's notes) is not carried over, and the manifest says so.
# The model's own files among them (config, tokenizer): also what an HF export of the full
# weights carries (engine/hf_weights.py); not a PEFT adapter's config, which would make
# from_pretrained take the export for an adapter.
MODEL_FILE = re.compile(
    r"(generation_|preprocessor_)?config\.json|"
    r"tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|"
    r"vocab\.(json|txt)|merges\.txt|spiece\.model|chat_template\.(jinja|json)")
KNOWN_FILE = re.compile(
    r"zero_to_fp32\.py|zero_to_torch\.py|trainer_state\.json|training_args\.bin|"
    r"rng_state(_\d+)?\.pth|scheduler\.pt|adapter_config\.json|" + MODEL_FILE.pattern)
# What `accelerator.save_state` writes beside its DeepSpeed tag dir (`pytorch_model`): rng
# states (with Accelerate's step counter) per process, the schedulers DeepSpeed does not
# own, dataloader samplers and states, the GradScaler, `register_for_checkpointing` objects.
ACCELERATE_FILE = re.compile(
    r"random_states_\d+\.pkl|(scheduler|sampler|dl_state_dict)(_\d+)?\.bin|scaler\.pt|"
    r"custom_checkpoint_\d+\.pkl")
TORCH_SUFFIXES = (".pt", ".pth")
OURS = {LATEST, LATEST_UNIVERSAL, MANIFEST}  # ours name our tags, not the base's


def extras_dir(base: CheckpointMeta) -> Path | None:
    """The save dir around the base's tag dir, when it belongs to that very tag, or to its
    run: a plain loop's partial save sits in the run's save dir, whose `latest` keeps naming
    the last full save (DeepSpeed's scripts there serve every save of the run)."""
    if base.files.save_dir is not None:
        return base.files.save_dir
    parent = base.files.tag_dir.parent
    latest = parent / LATEST
    if latest.is_file() and (base.files.partial or _names(latest) == base.files.tag):
        return parent
    return None


def _names(latest: Path) -> str | None:
    """The tag a `latest` file names; None if it names none (a link, too long, binary)."""
    try:
        return read_latest(latest)
    except CheckpointError:
        return None


# What mpitailor itself keeps beside an output while writing it (publish/staging.py): the lock
# of a merge into this save dir is not a file of the save that was left out.
MPITAILOR_WORK = re.compile(r"\..+\.mpitailor-(lock|staging|old)")


def sort_extras(base: CheckpointMeta) -> tuple[list[Path], list[Path], list[str]]:
    """The base save dir's files: (to copy, 16-bit weights to rebuild, left out), by name.
    Left out: unknown names, links and non-regular files, weights mpitailor cannot rebuild."""
    save_dir = extras_dir(base)
    if save_dir is None:
        return [], [], []
    copy, weights, left_out = [], [], []
    for p in sorted(save_dir.iterdir()):
        if p.name in OURS or MPITAILOR_WORK.fullmatch(p.name) or \
                (p.is_dir() and not p.is_symlink()):
            continue
        if p.is_symlink() or not p.is_file():
            left_out.append(p.name)
        elif WEIGHT_FILE.fullmatch(p.name):
            # Rebuilt from the merged fp32 weights: safetensors only. The base's .bin would
            # hold the base's weights, not the merged ones.
            (weights if ".safetensors" in p.name else left_out).append(p)
        elif KNOWN_FILE.fullmatch(p.name) or ACCELERATE_FILE.fullmatch(p.name):
            copy.append(p)
        else:
            left_out.append(p.name)
    return copy, weights, [p.name if isinstance(p, Path) else p for p in left_out]


def weight_files(base: CheckpointMeta) -> list[Path]:
    """16-bit safetensors weights beside the base's tag dir (rebuilt from merged weights)."""
    return sort_extras(base)[1]


@dataclass(frozen=True, slots=True)
class Extras:
    """The files around a base's tag dir that go into the output, read as bytes."""

    files: tuple[tuple[str, bytes], ...]   # (name, content)
    left_out: tuple[str, ...]              # names of the base's save dir not carried over
    # Accelerate's files, as large as the run made them: copied as files from `folder`
    # (engine/replicate.carry_files), never read whole nor sent to every rank
    carried: tuple[str, ...] = ()
    folder: Path | None = None


def read_extras(base: CheckpointMeta) -> Extras:
    """The extras as bytes (small files), for the ranks that write them into the output
    (rank 0, or every node's first rank under node-local storage). Torch files are
    safe-loaded first: one carrying a pickle payload is refused; Accelerate's are not loaded
    at all (above), nor read here: named in `carried`, they are copied as files."""
    copy, _, left_out = sort_extras(base)
    if left_out:
        log.warning("not carried over from %s (not part of a checkpoint, or 16-bit .bin weights "
                    "that would not match the merged ones; --export hf writes merged "
                    "HF weights): %s", extras_dir(base), ", ".join(left_out))
    out, carried = [], []
    for p in copy:
        if ACCELERATE_FILE.fullmatch(p.name):  # copied where it lies (Extras.carried)
            carried.append(p.name)
            continue
        out.append((p.name, _read_extra(p)))
    return Extras(tuple(out), tuple(left_out), tuple(carried), extras_dir(base))


def _read_extra(p: Path) -> bytes:
    """One extra's bytes, a torch file's safe-loaded first (a pickle payload is refused).
    One descriptor for both: the bytes carried are the ones the load checked, whatever the
    name stands for by the time they are read."""
    what = "a file of the base's save dir"
    # The save's own state (trainer state, rng, Accelerate's registered objects) is as
    # large as the run made it; the model's side files are bounded (boundedio.py).
    limit = MAX_SIDE_FILE_BYTES if MODEL_FILE.fullmatch(p.name) else sys.maxsize
    fd = open_regular(p, what)
    try:
        if p.suffix in TORCH_SUFFIXES:  # (Accelerate's files never get here)
            load(p, allow=("numpy", "deepspeed"), fd=fd)
        return read_bounded(fd, p, limit, what)
    finally:
        os.close(fd)
