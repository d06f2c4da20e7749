"""Parameter name -> layer key (`layers.{i}`, `embed`, `norm`, `lm_head`, `other`).

The unit of a layer-wise merge is a *layer key*. Decoder blocks are `layers.{i}`; the
auxiliary layers are `embed` (token and position embeddings), `norm` (the final norm),
`lm_head`; anything else is `other`. Families are plain regex tables in a registry; a
recipe may add its own patterns, which are tried first.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

AUX_KEYS = ("embed", "norm", "lm_head")
OTHER = "other"

# Each pattern is matched against the whole parameter name; `{i}` in the key is the
# pattern's first group. Order matters only within a family.
FAMILIES: dict[str, tuple[tuple[str, str], ...]] = {
    # Llama, Mistral, Qwen2 and most HF decoder-only models share this naming.
    "llama": (
        (r"(?:model\.)?embed_tokens\..*", "embed"),
        (r"(?:model\.)?layers\.(\d+)\..*", "layers.{i}"),
        (r"(?:model\.)?norm\..*", "norm"),
        (r"lm_head\..*", "lm_head"),
    ),
    "gpt2": (
        (r"(?:transformer\.)?(?:wte|wpe)\..*", "embed"),
        (r"(?:transformer\.)?h\.(\d+)\..*", "layers.{i}"),
        (r"(?:transformer\.)?ln_f\..*", "norm"),
        (r"lm_head\..*", "lm_head"),
    ),
    "gpt_neox": (
        (r"(?:gpt_neox\.)?embed_in\..*", "embed"),
        (r"(?:gpt_neox\.)?layers\.(\d+)\..*", "layers.{i}"),
        (r"(?:gpt_neox\.)?final_layer_norm\..*", "norm"),
        (r"embed_out\..*", "lm_head"),
    ),
}
FAMILIES["mistral"] = FAMILIES["llama"]
FAMILIES["qwen2"] = FAMILIES["llama"]

_WRAPPERS = re.compile(r"^(?:module\.|_orig_mod\.)+")


class LayerClassifier:
    """Maps parameter names to layer keys with user patterns first, then the families."""

    def __init__(self, extra: Mapping[str, str] | None = None,
                 families: Iterable[str] = ("llama", "gpt2", "gpt_neox")) -> None:
        table: list[tuple[str, str]] = list((extra or {}).items())
        for fam in families:
            table.extend(FAMILIES[fam])
        self._table = [(re.compile(p), key) for p, key in table]

    def __call__(self, name: str) -> str:
        bare = _WRAPPERS.sub("", name)
        for pattern, key in self._table:
            m = pattern.fullmatch(bare)
            if m:
                return key.format(i=int(m.group(1))) if "{i}" in key else key
        return OTHER


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
