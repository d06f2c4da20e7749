"""Recipes: which source each layer comes from. YAML in, a frozen `Recipe` out.

Two spellings, one meaning. MergeKit's `slices: [{sources: [{model, layer_range}]}]`
(half-open ranges, one source per slice), or the short form with named sources:

    sources: {a: ckpt/global_step10, b: ckpt/global_step5}
    layers: {even: a, odd: b}          # or "0-13": a, "14-27": b (inclusive), "7": a, rest: b

plus `embed`, `norm`, `lm_head`, `other` (parameters outside any layer) and `base` (counters,
lr scheduler, rng states, trainer state, config, tokenizer; default: the newest source).
Paths are relative to the recipe's own folder; `${VAR}` is expanded from the environment.
Unknown keys are errors, reported with their YAML line.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.boundedio import TooLarge, read_small
from mpitailor.planning.layers import check_patterns

MAX_RECIPE_BYTES = 4 << 20  # a recipe is a page of YAML; anything this big is the wrong file
SELECTOR_RE = re.compile(r"(\d+)(?:-(\d+))?|even|odd|rest")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SliceSource(_Strict):
    model: str
    layer_range: tuple[int, int]


class Slice(_Strict):
    sources: list[SliceSource] = Field(min_length=1)

    @field_validator("sources")
    @classmethod
    def one_source(cls, v: list[SliceSource]) -> list[SliceSource]:
        if len(v) != 1:
            raise ValueError("a slice takes its layers from exactly one source (mpitailor "
                             "selects layers, it does not blend them); split it into slices")
        return v


class OutputSpec(_Strict):
    path: str
    world_size: int | None = Field(default=None, ge=1)


_BRANCHES = {"str", "OutputSpec"}  # pydantic names union branches in error locations


class RecipeModel(_Strict):
    merge_method: Literal["passthrough"] | None = None
    dtype: str | None = None
    sources: dict[str, str] | None = None
    slices: list[Slice] | None = None
    layers: dict[str, str] | None = None
    embed: str | None = None
    norm: str | None = None
    lm_head: str | None = None
    other: str | None = None
    base: str | None = Field(default=None, alias="base_model")
    adam_step: Literal["newest", "oldest", "base"] = "newest"
    output: str | OutputSpec | None = None
    layer_patterns: dict[str, str] | None = None
    safe_globals: list[str] | None = None


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
    safe_globals: tuple[str, ...] = ()           # client-state classes to build for real

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
    try:
        node = yaml.compose(text, Loader=_UniqueKeyLoader)
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{origin}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{origin}: a recipe is a YAML mapping (slices:/layers:, sources:, ...)")
    try:
        model = RecipeModel.model_validate(raw)
    except ValidationError as e:
        # A misspelt key also makes its correct spelling "missing": report the typo.
        # Of a union's branches (output: a path, or {path, world_size}) the one that got
        # deepest into the value says what is wrong; the branch's name is not a key.
        err = sorted(e.errors(), key=lambda x: (x["type"] != "extra_forbidden",
                                                -len(x["loc"])))[0]
        loc = tuple(p for p in err["loc"] if p not in _BRANCHES)
        key = ".".join(str(p) for p in loc) or "(top level)"
        what = "unknown key (check its spelling)" if err["type"] == "extra_forbidden" \
            else err["msg"].removeprefix("Value error, ")
        raise UserError(f"{origin}{_line_of(node, loc)}: {key}: {what}") from None
    if model.layer_patterns:
        check_patterns(model.layer_patterns, where=f"{origin}{_line_of(node, ('layer_patterns',))}"
                                                   f": layer_patterns")
    return _with_world_size(_resolve(model, text, origin, base_dir, output), world_size)


def recipe_from(doc: dict, origin: str, header: str = "",
                world_size: int | None = None) -> Recipe:
    """A recipe built in code (recover's chain, export's one source), checked as a recipe
    file is. Its paths are absolute and taken literally: a `$` in a save dir's name is a
    `$`, never an environment variable. `text` is the YAML a user could have written (header:
    comment lines before it), for the manifest and `--emit-recipe`."""
    text = header + yaml.safe_dump(doc, sort_keys=False)
    try:
        model = RecipeModel.model_validate(doc)
    except ValidationError as e:
        raise UserError(f"{origin}: {e.errors()[0]['msg']}") from None
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}: give each key once",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _resolve(m: RecipeModel, text: str, origin: str, base_dir: Path,
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
    out = output if output is not None else (
        m.output.path if isinstance(m.output, OutputSpec) else m.output)
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
                  world_size=m.output.world_size if isinstance(m.output, OutputSpec) else None,
                  safe_globals=tuple(m.safe_globals or ()))


def _slices_to_rules(slices: list[Slice], origin: str) -> list[tuple[str, str]]:
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


def _line_of(node, loc) -> str:
    """' line N' of the YAML node at pydantic location `loc`, as far as it can be followed."""
    line = None
    for part in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(part)]
            node = match[0][1] if match else None
            if match:
                line = match[0][0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            node = None
    return f" line {line}" if line else ""
