"""Parameter name -> layer key (`layers.{i}`, `embed`, `norm`, `lm_head`, `other`).

The unit of a layer-wise merge is a *layer key*. Decoder blocks are `layers.{i}`; the
auxiliary layers are `embed` (token and position embeddings), `norm` (the final norm),
`lm_head`; anything else is `other`. One table of regexes covers the usual spellings of
decoder-only models; a recipe, a checkpointer or `recover` may add patterns, tried first.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TypeVar


from mpitailor.errors import UserError

T = TypeVar("T")

AUX_KEYS = ("embed", "norm", "lm_head")
OTHER = "other"
LAYER_KEY = "layers.{i}"
PATTERN_KEYS = (LAYER_KEY, *AUX_KEYS, OTHER)
MATCH_SECONDS = 1.0  # per parameter name: a pattern that needs longer backtracks badly

# The spellings of HF decoder-only models (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi, Phi-3,
# GPT-2, GPT-Neo, GPT-J, GPT-NeoX, GPT-BigCode, OPT, Falcon, BLOOM, StableLM, OLMo, MPT,
# CodeGen, BioGPT, XGLM, Mamba, RWKV, ...): decoder blocks are `<container>.N.` under any
# prefix, the first such container from the left; auxiliary modules by their usual names.
# Each pattern is matched against the whole parameter name; `{i}` is the first group.
_PREFIX = r"(?:\w+\.)*?"
DECODER_RULES: tuple[tuple[str, str], ...] = (
    (_PREFIX + r"(?:layers|h|blocks|layer)\.(\d+)\..*", LAYER_KEY),
    # Heads before embeddings: GPT-NeoX's head is `embed_out`.
    (r"(?:lm_head|embed_out|output_projection|head)\..*", "lm_head"),
    # Any module named *embed* (embed_tokens, embeddings, word_embeddings_layernorm,
    # layernorm_embedding, ...), GPT-2's wte/wpe, OPT's project_in.
    (_PREFIX + r"(?:\w*embed\w*|wte|wpe|project_in)\..*", "embed"),
    # Outside the blocks, any module named *norm* (norm, ln_f, final_layer_norm, norm_f, ...).
    (_PREFIX + r"(?:\w*norm\w*|ln_f|ln_out|project_out)\..*", "norm"),
)

_WRAPPERS = re.compile(r"^(?:module\.|_orig_mod\.)+")


def check_patterns(patterns: Mapping[str, str], where: str = "layer_patterns") -> list:
    """User patterns compiled, or a UserError naming the pattern and the fix."""
    if not patterns:
        return []
    # `regex`, not `re`: its matches can be time-boxed, the standard library's cannot.
    # Imported here: only user patterns need it, and every rank imports this module.
    import regex
    compiled = []
    for pattern, key in patterns.items():
        if key not in PATTERN_KEYS:
            raise UserError(f"{where}: {pattern!r}: key {key!r} is not one of "
                            f"{', '.join(PATTERN_KEYS)}")
        try:
            rx = regex.compile(pattern)
        except regex.error as e:
            raise UserError(f"{where}: {pattern!r} is not a valid regular expression "
                            f"({e})") from None
        if key == LAYER_KEY and rx.groups < 1:
            raise UserError(f"{where}: {pattern!r} -> {key}: the pattern needs a group that "
                            f"captures the layer number, e.g. 'model\\.decoder\\.layers\\."
                            f"(\\d+)\\..*'")
        compiled.append((rx, key))
    return compiled


class LayerClassifier:
    """Maps parameter names to layer keys: user patterns first, then DECODER_RULES.

    A pattern matches the whole parameter name (after `module.`/`_orig_mod.` wrappers are
    stripped); for `layers.{i}` its first group is the layer number."""

    def __init__(self, extra: Mapping[str, str] | None = None) -> None:
        self.patterns = dict(extra or {})
        self._user = check_patterns(self.patterns)
        self._table = [(re.compile(p), key) for p, key in DECODER_RULES]

    def __call__(self, name: str) -> str:
        bare = _WRAPPERS.sub("", name)
        for rx, key in self._user:
            try:
                m = rx.fullmatch(bare, timeout=MATCH_SECONDS)
            except TimeoutError:
                raise UserError(f"layer_patterns: {rx.pattern!r} took over {MATCH_SECONDS:g} s "
                                f"on parameter {name!r}; simplify it (nested repetition "
                                f"backtracks)") from None
            if m:
                return _key(key, m, name, rx.pattern)
        for pattern, key in self._table:
            m = pattern.fullmatch(bare)
            if m:
                return _key(key, m, name, pattern.pattern)
        return OTHER


def _key(key: str, m, name: str, pattern: str) -> str:
    if "{i}" not in key:
        return key
    try:
        return key.format(i=int(m.group(1)))
    except (TypeError, ValueError):
        raise UserError(f"layer_patterns: {pattern!r} matched {name!r} but its first group "
                        f"({m.group(1)!r}) is not a layer number") from None


def layer_index(key: str) -> int | None:
    """`layers.7` -> 7; auxiliary and other keys -> None."""
    return int(key.split(".", 1)[1]) if key.startswith("layers.") else None


def sort_keys(keys: Iterable[str]) -> list[str]:
    """Model order: embed, layers by index, norm, lm_head, other."""
    def rank(k: str) -> tuple[int, int]:
        i = layer_index(k)
        if i is not None:
            return (1, i)
        return ({"embed": 0, "norm": 2, "lm_head": 3}.get(k, 4), 0)
    return sorted(set(keys), key=rank)


classify = LayerClassifier()


def layer_runs(items: Iterable[tuple[int, T]]) -> list[tuple[str, T]]:
    """Consecutive layer numbers with the same value, as recipe selectors: [(0, a), (1, a),
    (2, b), (5, b)] -> [("0-1", a), ("2", b), ("5", b)]. The one "layer numbers -> ranges"
    helper (recipes that recover writes, and messages)."""
    out: list[tuple[str, T]] = []
    first = prev = value = None
    for i, v in sorted(items, key=lambda iv: iv[0]):
        if first is not None and (i != prev + 1 or v != value):
            out.append((f"{first}-{prev}" if prev != first else str(first), value))
            first = None
        if first is None:
            first, value = i, v
        prev = i
    if first is not None:
        out.append((f"{first}-{prev}" if prev != first else str(first), value))
    return out
