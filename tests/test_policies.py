"""Save policies are pure: which layers each save writes, and which policies are refused."""
from __future__ import annotations

import pytest

from mpitailor.errors import UserError
from mpitailor.training.policies import Adaptive, Filter, Parity, make_policy

KEYS = ["embed"] + [f"layers.{i}" for i in range(8)] + ["norm", "lm_head"]
AUX = {"embed", "norm", "lm_head"}


def layers(decision):
    return sorted(int(k.split(".")[1]) for k in decision.layers if k.startswith("layers."))


def test_parity_alternates_and_keeps_aux():
    p = Parity(full_every=4)
    assert [p.decide(i, KEYS).full for i in range(6)] == [True, False, False, False, True, False]
    assert layers(p.decide(1, KEYS)) == [1, 3, 5, 7] and layers(p.decide(2, KEYS)) == [0, 2, 4, 6]
    assert AUX <= p.decide(1, KEYS).layers


def test_filter_first_and_last_every_save_others_every_kth():
    f = Filter(always=(0, 1, -2, -1), every=4)
    f.validate(KEYS)
    assert layers(f.decide(1, KEYS)) == [0, 1, 6, 7]
    assert layers(f.decide(4, KEYS)) == list(range(8))
    assert AUX <= f.decide(3, KEYS).layers
    assert not Filter(every=4, aux_always=False).decide(1, KEYS).layers & AUX
    staggered = Filter(always=(0, -1), every=3, stagger=True)
    shares = [set(layers(staggered.decide(i, KEYS))) - {0, 7} for i in range(1, 4)]
    assert shares == [{2, 5}, {1, 4}, {3, 6}]  # every other layer once per 3 saves


def test_adaptive_threshold_top_fraction_and_staleness():
    rel = {k: 0.001 for k in KEYS} | {"layers.2": 0.5, "layers.5": 0.2}
    a = Adaptive(threshold=0.1, max_staleness=3)
    assert layers(a.decide(1, KEYS, rel, {k: 0 for k in KEYS})) == [2, 5]
    stale = {k: 0 for k in KEYS} | {"layers.7": 2}
    assert layers(a.decide(1, KEYS, rel, stale)) == [2, 5, 7]
    top = Adaptive(top_fraction=0.2, max_staleness=None, full_every=10)
    assert len(top.decide(1, KEYS, rel, {}).layers) == 3   # ceil(0.2 * 11)
    assert Adaptive(threshold=0.1).decide(0, KEYS).full      # save 0 is always full


@pytest.mark.parametrize("policy,message", [
    (Filter(every=0), "would never be saved"),
    (Filter(always=(0, 12)), "always lists layer 12"),
    (Adaptive(threshold=0.1, max_staleness=None), "never be saved again"),
    (Adaptive(threshold=0.1, top_fraction=0.5), "exactly one of threshold or top_fraction"),
    (Parity(full_every=-1), "full_every must be >= 0"),
])
def test_policies_that_could_starve_a_layer_are_refused(policy, message):
    with pytest.raises(UserError, match=message):
        policy.validate(KEYS)


def test_registry():
    assert make_policy("filter", every=2) == Filter(every=2)
    with pytest.raises(UserError, match="unknown policy 'lru'"):
        make_policy("lru")
    with pytest.raises(UserError, match="policy parity:"):
        make_policy("parity", nope=1)


def test_the_partial_saves_a_policy_can_make():
    """What sizes the host buffers of asynchronous saves: every layer set a partial save of
    the policy can hold."""
    odd, even = Parity().decide(1, KEYS).layers, Parity().decide(2, KEYS).layers
    assert sorted(map(sorted, Parity().partial_layer_sets(KEYS))) == sorted([sorted(odd),
                                                                              sorted(even)])
    sets = Filter(every=4).partial_layer_sets(KEYS)
    assert frozenset(KEYS) in sets and len(sets) == 2  # `always` alone, and every layer
    staggered = Filter(always=(0, -1), every=3, stagger=True).partial_layer_sets(KEYS)
    assert {frozenset(Filter(always=(0, -1), every=3, stagger=True).decide(i, KEYS).layers)
            for i in range(1, 4)} == set(staggered)
    assert Adaptive(threshold=0.1).partial_layer_sets(KEYS) == [frozenset(KEYS)]
