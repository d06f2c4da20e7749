"""Recipes: which source each layer comes from. YAML in, a frozen `Recipe` out.

Two spellings, one meaning. MergeKit's `slices: [{sources: [{model, layer_range}]}]`
(half-open ranges, one source per slice), or the short form with named sources:

    sources: {a: ckpt/global_step10, b: ckpt/global_step5}
    layers: {even: a, odd: b}          # or "0-13": a, "14-27": b (inclusive), "7": a, rest: b

plus `embed`, `norm`, `lm_head`, `other` (parameters outside any layer) and `base` (counters,
lr scheduler, rng states, trainer state, config, tokenizer; default: the newest source).
Paths are relative to the recipe's own folder; `${VAR}` is expanded from the environment.
Unknown keys are errors, reported with their YAML line.

The YAML and its schema (recipe_schema.py: PyYAML, pydantic) are imported only where a recipe
is read: on rank 0, which broadcasts the `Recipe`; the other ranks never pay for them.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.io import TooLarge, read_small
from mpitailor.planning.layers import check_patterns

MAX_RECIPE_BYTES = 4 << 20  # a recipe is a page of YAML; anything this big is the wrong file
SELECTOR_RE = re.compile(r"(\d+)(?:-(\d+))?|even|odd|rest")


@dataclass(frozen=True, slots=True)
class Recipe:
    """A validated recipe. Sources are absolute paths keyed by the name the recipe used."""

    origin: str                                  # recipe file, for messages
    text: str                                    # verbatim, for the manifest
    sources: tuple[tuple[str, Path], ...]
    layer_rules: tuple[tuple[str, str], ...]     # (selector, source name) as written
    aux: tuple[tuple[str, str], ...]             # embed/norm/lm_head/other -> source name
    base: str | None
    adam_step: str
    output: Path | None
    layer_patterns: tuple[tuple[str, str], ...]
    dtype: str | None
    world_size: int | None = None                # reshard the output to this world size
    safe_globals: tuple[str, ...] = ()           # classes to accept (safeload.trust)

    def source_path(self, name: str) -> Path:
        return dict(self.sources)[name]


def load_recipe(path: Path | str, output: str | None = None,
                world_size: int | None = None) -> Recipe:
    """Read and validate a recipe file; UserError naming the file, line and key."""
    path = Path(path)
    try:  # a regular file (a FIFO would block the open), links followed: a user's own path
        raw = read_small(path, MAX_RECIPE_BYTES, "a recipe (a short YAML file)", follow=True)
    except TooLarge:
        raise UserError(f"{path}: larger than {MAX_RECIPE_BYTES >> 20} MiB; a recipe is a short "
                        f"YAML file (is this the right file?)") from None
    except CheckpointError as e:
        raise UserError(str(e)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if not text and raw or "\0" in text:
        raise UserError(f"{path}: not a text (UTF-8) file; a recipe is YAML (is this the "
                        f"right file?)")
    return parse_recipe(text, origin=str(path), base_dir=path.resolve().parent, output=output,
                        world_size=world_size)


def parse_recipe(text: str, origin: str, base_dir: Path, output: str | None = None,
                 world_size: int | None = None) -> Recipe:
    from mpitailor.planning.recipe_schema import line_of, parse
    model, node = parse(text, origin)
    if model.layer_patterns:
        check_patterns(model.layer_patterns, where=f"{origin}{line_of(node, ('layer_patterns',))}"
                                                   f": layer_patterns")
    return _with_world_size(_resolve(model, text, origin, base_dir, output), world_size)


def recipe_from(doc: dict, origin: str, header: str = "",
                world_size: int | None = None) -> Recipe:
    """A recipe built in code (recover's chain, export's one source), checked as a recipe
    file is. Its paths are absolute and taken literally: a `$` in a save dir's name is a
    `$`, never an environment variable. `text` is the YAML a user could have written (header:
    comment lines before it), for the manifest and `--emit-recipe`."""
    from mpitailor.planning.recipe_schema import dump, validate
    text = header + dump(doc)
    model = validate(doc, origin)
    if model.layer_patterns:
        check_patterns(model.layer_patterns, where=f"{origin}: layer_patterns")
    return _with_world_size(_resolve(model, text, origin, Path("/"), None, literal=True),
                            world_size)


def _with_world_size(recipe: Recipe, world_size: int | None) -> Recipe:
    if world_size is None:
        return recipe
    if world_size < 1:
        raise UserError(f"{recipe.origin}: --world-size must be >= 1, got {world_size}")
    return dataclasses.replace(recipe, world_size=world_size)


def _resolve(m, text: str, origin: str, base_dir: Path,
             output: str | None, literal: bool = False) -> Recipe:
    if (m.slices is None) == (m.layers is None):
        raise UserError(f"{origin}: give exactly one of `slices:` (MergeKit form) or `layers:`")
    named = {k: _path(v, base_dir, origin, f"sources.{k}", literal)
             for k, v in (m.sources or {}).items()}
    sources: dict[str, Path] = dict(named)

    def ref(value: str, key: str) -> str:
        if value not in sources:
            sources[value] = _path(value, base_dir, origin, key, literal)
        return value

    if m.slices is not None:
        rules = _slices_to_rules(m.slices, origin)
        rules = tuple((sel, ref(src, f"slices[{i}].sources[0].model"))
                      for i, (sel, src) in enumerate(rules))
    else:
        for sel in m.layers:
            if not SELECTOR_RE.fullmatch(sel):
                raise UserError(f"{origin}: layers: {sel!r} is not a layer selector; use "
                                f"'N', 'A-B' (inclusive), 'even', 'odd' or 'rest'")
        rules = tuple((sel, ref(src, f"layers.{sel}")) for sel, src in m.layers.items())
    aux = tuple((k, ref(v, k)) for k in ("embed", "norm", "lm_head", "other")
                if (v := getattr(m, k)) is not None)
    base = ref(m.base, "base") if m.base is not None else None
    if output is not None and not output.strip():
        raise UserError("-o/--output: an empty path; give the output directory to create")
    spec = None if isinstance(m.output, str) else m.output  # {path, world_size} or None
    out = output if output is not None else (spec.path if spec is not None else m.output)
    out_path = None
    if out is not None:
        out_path = Path(out) if output is not None or literal else \
            _path(out, base_dir, origin, "output", literal)
        # Absolute, but its last part not followed: an output that is a symbolic link is
        # refused when staging (publish/staging.py), never written through.
        out_path = out_path.parent.resolve() / out_path.name if out_path.name else \
            out_path.resolve()
    return Recipe(origin=origin, text=text, sources=tuple(sources.items()), layer_rules=rules,
                  aux=aux, base=base, adam_step=m.adam_step, output=out_path,
                  layer_patterns=tuple((m.layer_patterns or {}).items()), dtype=m.dtype,
                  world_size=spec.world_size if spec is not None else None,
                  safe_globals=tuple(m.safe_globals or ()))


def _slices_to_rules(slices: list, origin: str) -> list[tuple[str, str]]:
    """MergeKit slices -> inclusive range selectors; layers must keep their positions."""
    rules, expect = [], 0
    for i, sl in enumerate(slices):
        src = sl.sources[0]
        a, b = src.layer_range
        if b <= a:
            raise UserError(f"{origin}: slices[{i}]: layer_range [{a}, {b}) is empty; ranges "
                            f"are half-open [first, last+1)")
        if a != expect:
            kind = f"gap: layers {expect}-{a - 1} are in no slice" if a > expect else \
                f"overlap: layers {a}-{expect - 1} are in two slices"
            raise UserError(f"{origin}: slices[{i}]: layer_range [{a}, {b}) does not start "
                            f"where the previous slice ended ({expect}); {kind}. Each layer "
                            f"keeps its position, so cover every layer exactly once, in order")
        rules.append((f"{a}-{b - 1}", src.model))
        expect = b
    return rules


def _path(value: str, base_dir: Path, origin: str, key: str, literal: bool = False) -> Path:
    if literal:
        return Path(value).resolve()
    expanded = os.path.expandvars(value)
    if "$" in expanded:
        raise UserError(f"{origin}: {key}: {value!r} uses an environment variable that is "
                        f"not set")
    p = Path(expanded).expanduser()
    return (p if p.is_absolute() else base_dir / p).resolve()
