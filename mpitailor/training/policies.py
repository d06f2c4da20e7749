"""Which layers a save writes: parity, filter, adaptive; a full save every K saves.

A policy is a pure function of the save's index, the model's layer keys, and (adaptive only)
each layer's relative update since it was last saved and its staleness. Save 0 is always
full: recovery needs a full checkpoint to start from. `validate` refuses a policy that could
leave some layer unsaved forever.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpitailor.errors import UserError
from mpitailor.facade import layer_index


@dataclass(frozen=True, slots=True)
class Decision:
    full: bool
    layers: frozenset[str]   # all keys when full


@dataclass(frozen=True)
class Policy:
    """full_every: saves 0, K, 2K, ... are full (0: only save 0)."""

    full_every: int = 0
    needs_stats = False

    def validate(self, keys: list[str]) -> None:
        if self.full_every < 0:
            raise UserError(f"{self.name}: full_every must be >= 0, got {self.full_every}")

    def is_full(self, save_index: int) -> bool:
        return save_index == 0 or (self.full_every > 0 and save_index % self.full_every == 0)

    def decide(self, save_index: int, keys: list[str], rel_update: dict[str, float] | None = None,
               staleness: dict[str, int] | None = None) -> Decision:
        if self.is_full(save_index):
            return Decision(True, frozenset(keys))
        chosen = self.choose(save_index, keys, rel_update or {}, staleness or {})
        return Decision(False, frozenset(chosen))

    def choose(self, save_index: int, keys: list[str], rel_update: dict[str, float],
               staleness: dict[str, int]) -> set[str]:
        raise NotImplementedError

    def partial_layer_sets(self, keys: list[str]) -> list[frozenset[str]]:
        """Every set of layers a partial save can hold (the largest sizes the host buffers
        of asynchronous saves). By default any layer may be chosen: all of them."""
        return [frozenset(keys)]

    def _cycle(self, keys: list[str], period: int) -> list[frozenset[str]]:
        """The partial saves of a policy whose choice repeats every `period` saves."""
        return list({frozenset(self.choose(i, keys, {}, {})) for i in range(1, period + 1)})

    @property
    def name(self) -> str:
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Parity(Policy):
    """Even layers at odd-numbered saves, odd layers at the others; auxiliary layers always."""

    def choose(self, save_index, keys, rel_update, staleness):
        return {k for k in keys if (i := layer_index(k)) is None or i % 2 == save_index % 2}

    def partial_layer_sets(self, keys):
        return self._cycle(keys, 2)


@dataclass(frozen=True)
class Filter(Policy):
    """`always` at every save (negative indices count from the end, like Python), the other
    layers every `every`-th save: all together, or with `stagger` a 1/every share of them at
    each save (same bytes on average, no spike). Auxiliary layers are saved like `always`
    unless aux_always is False."""

    always: tuple[int, ...] = (0, 1, -2, -1)
    every: int = 4
    aux_always: bool = True
    stagger: bool = False

    def validate(self, keys):
        super().validate(keys)
        n = _n_layers(keys)
        bad = [i for i in self.always if not -n <= i < n]
        if bad:
            raise UserError(f"filter: always lists layer {bad[0]} but the model has layers "
                            f"0-{n - 1}")
        if self.every < 1 and not self.full_every:
            raise UserError("filter: every must be >= 1 (or set full_every): otherwise the "
                            "layers outside `always` would never be saved after save 0")

    def choose(self, save_index, keys, rel_update, staleness):
        n = _n_layers(keys)
        always = {i % n for i in self.always}

        def due(i: int) -> bool:
            if self.every < 1:
                return False
            return (i + save_index) % self.every == 0 if self.stagger \
                else save_index % self.every == 0

        return {k for k in keys if ((i := layer_index(k)) is None and self.aux_always)
                or (i is not None and (i in always or due(i)))}

    def partial_layer_sets(self, keys):
        return self._cycle(keys, max(self.every, 1))


@dataclass(frozen=True)
class Adaptive(Policy):
    """Layers whose relative update since their last save, ||w - w_saved|| / ||w_saved||, is
    at least `threshold` (or the `top_fraction` that moved most); any layer not saved for
    `max_staleness` saves is saved regardless."""

    threshold: float | None = None
    top_fraction: float | None = None
    max_staleness: int | None = 4
    needs_stats = True

    def validate(self, keys):
        super().validate(keys)
        if (self.threshold is None) == (self.top_fraction is None):
            raise UserError("adaptive: set exactly one of threshold or top_fraction")
        if self.top_fraction is not None and not 0 < self.top_fraction <= 1:
            raise UserError(f"adaptive: top_fraction must be in (0, 1], got {self.top_fraction}")
        if not self.max_staleness and not self.full_every:
            raise UserError("adaptive: set max_staleness (or full_every): a layer that moves "
                            "less than the threshold would otherwise never be saved again")

    def choose(self, save_index, keys, rel_update, staleness):
        if self.threshold is not None:
            chosen = {k for k in keys if rel_update.get(k, math.inf) >= self.threshold}
        else:
            n = max(1, math.ceil(self.top_fraction * len(keys)))
            ranked = sorted(keys, key=lambda k: rel_update.get(k, math.inf), reverse=True)
            chosen = set(ranked[:n])
        if self.max_staleness:
            chosen |= {k for k in keys if staleness.get(k, 0) + 1 >= self.max_staleness}
        return chosen


POLICIES: dict[str, type[Policy]] = {"parity": Parity, "filter": Filter, "adaptive": Adaptive}


def make_policy(name: str, **options) -> Policy:
    """A policy by registry name, e.g. make_policy('filter', every=4, full_every=8)."""
    if name not in POLICIES:
        raise UserError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    try:
        return POLICIES[name](**options)
    except TypeError as e:
        raise UserError(f"policy {name}: {e}") from None


def _n_layers(keys: list[str]) -> int:
    idx = [i for k in keys if (i := layer_index(k)) is not None]
    return max(idx) + 1 if idx else 0
