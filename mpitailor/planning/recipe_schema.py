"""The recipe's YAML and its schema: PyYAML and pydantic, imported only where a recipe is read
(recipe.py; rank 0 of a job). Errors are UserErrors naming the file, line and key."""
from __future__ import annotations

from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mpitailor.errors import UserError


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

    @field_validator("layers", mode="before")
    @classmethod
    def number_selectors(cls, v):
        # `layers: {3: old}`: YAML reads an unquoted number as an int; the selector is "3"
        if isinstance(v, dict):
            return {str(k) if type(k) is int else k: x for k, x in v.items()}
        return v


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (PyYAML keeps the last one silently), and a
    key that is a list or a mapping (YAML's `? [a, b]`), which no recipe key is."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "a key that is a list or a mapping: recipe keys are names "
                    "(slices, sources, model, ...)", key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}: give each key once",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse(text: str, origin: str) -> tuple[RecipeModel, object]:
    """The recipe text validated, and its YAML node tree (for line numbers)."""
    try:
        node, raw = _read(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{origin}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{origin}: a recipe is a YAML mapping (slices:/layers:, sources:, ...)")
    try:
        return RecipeModel.model_validate(raw), node
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
        raise UserError(f"{origin}{line_of(node, loc)}: {key}: {what}") from None


def _read(text: str) -> tuple[object, object]:
    """(yaml.compose(text), yaml.load(text)) under _UniqueKeyLoader, the text parsed once.
    Constructing leaves the node tree as composed, for line_of: PyYAML rewrites a mapping
    only to flatten `<<:` merge keys, and _UniqueKeyLoader refuses one before that (a merge
    key has no constructor of its own)."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        return node, None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def validate(doc: dict, origin: str) -> RecipeModel:
    """A recipe built in code, checked as a recipe file is."""
    try:
        return RecipeModel.model_validate(doc)
    except ValidationError as e:
        raise UserError(f"{origin}: {e.errors()[0]['msg']}") from None


def dump(doc: dict) -> str:
    """The YAML a user could have written for doc."""
    return yaml.safe_dump(doc, sort_keys=False)


def line_of(node, loc) -> str:
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
