"""The kind names come from the kind objects: ``Kind``, ``KINDS`` and the kind tuples list
exactly the kinds of ``KIND_SPECS``; ``KINDS`` is a tuple of names whose former dict uses
still work, deprecated."""

from __future__ import annotations

import pickle
import typing
import warnings

import pytest

import linattn as la
from linattn.features import (
    KIND_SPECS,
    KINDS,
    OPRF_KINDS,
    SOFTMAX_KINDS,
    FeatureKind,
    FeatureMap,
    Kind,
    kind_spec,
)

#: ``linattn.KINDS`` as it was, a dict ``{name: (random, rows_per_feature)}`` (0.1.0),
#: written out: the values its deprecated dict uses must still give.
OLD_KINDS = {
    "positive": (True, 1),
    "hyperbolic": (True, 2),
    "oprf": (True, 1),
    "hyperbolic_oprf": (True, 2),
    "trigonometric": (True, 2),
    "random_relu": (True, 1),
    "elu": (False, 1),
    "relu": (False, 1),
    "hedgehog": (False, 2),
}


def test_the_kind_literal_names_every_kind_object() -> None:
    """A kind added to ``KIND_SPECS`` without its name in ``Kind`` (or the reverse) fails."""
    assert typing.get_args(Kind) == tuple(KIND_SPECS)
    assert all(spec.name == name for name, spec in KIND_SPECS.items())
    assert all(isinstance(spec, FeatureKind) for spec in KIND_SPECS.values())


def test_kinds_is_a_tuple_of_every_kind_name() -> None:
    assert la.KINDS is KINDS
    assert isinstance(KINDS, tuple)
    assert tuple(KINDS) == tuple(KIND_SPECS) == typing.get_args(Kind)
    assert sorted(KINDS) == sorted(OLD_KINDS)


def test_kinds_behaves_as_a_tuple_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(KINDS) == list(OLD_KINDS)
        assert "hedgehog" in KINDS and "softmax" not in KINDS
        assert len(KINDS) == len(OLD_KINDS)
        assert KINDS[0] == "positive" and KINDS[-1] == "hedgehog"
        assert KINDS[1:3] == ("hyperbolic", "oprf")
        assert KINDS.index("elu") == list(OLD_KINDS).index("elu")
        assert repr(KINDS) == repr(tuple(OLD_KINDS))
        assert pickle.loads(pickle.dumps(KINDS)) == KINDS
        with pytest.raises(IndexError):
            KINDS[len(OLD_KINDS)]


@pytest.mark.parametrize("name", list(OLD_KINDS))
def test_kinds_indexed_by_name_warns_and_gives_the_old_value(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=r"KINDS\[name\] is deprecated.*kind_spec") as w:
        value = la.KINDS[name]
    assert value == OLD_KINDS[name]
    assert w[0].filename == __file__  # the warning points at the caller
    spec = kind_spec(name)
    assert (spec.random, spec.rows_per_feature) == OLD_KINDS[name]


def test_the_former_dict_methods_warn_and_give_the_old_values() -> None:
    with pytest.warns(DeprecationWarning, match=r"KINDS\.items\(\) is deprecated"):
        assert dict(la.KINDS.items()) == OLD_KINDS
    with pytest.warns(DeprecationWarning, match=r"KINDS\.keys\(\)"):
        assert list(la.KINDS.keys()) == list(OLD_KINDS)
    with pytest.warns(DeprecationWarning, match=r"KINDS\.values\(\)"):
        assert list(la.KINDS.values()) == list(OLD_KINDS.values())
    with pytest.warns(DeprecationWarning, match=r"KINDS\.get"):
        assert la.KINDS.get("oprf") == (True, 1)
    with pytest.warns(DeprecationWarning, match=r"KINDS\.get"):
        assert la.KINDS.get("softmax", "none") == "none"
    with (
        pytest.warns(DeprecationWarning, match=r"KINDS\[name\]"),
        pytest.raises(KeyError, match="softmax"),
    ):
        la.KINDS["softmax"]


def test_kind_spec_names_the_kinds_it_refuses() -> None:
    assert kind_spec("oprf") is KIND_SPECS["oprf"]
    for bad in ("softmax", None, 3):
        with pytest.raises(ValueError, match=r"kind must be one of \[.*'elu'.*\]; got"):
            kind_spec(bad)


def test_the_kind_tuples_follow_the_flags() -> None:
    assert SOFTMAX_KINDS == ("positive", "hyperbolic", "oprf", "hyperbolic_oprf", "trigonometric")
    assert OPRF_KINDS == ("oprf", "hyperbolic_oprf")
    assert tuple(n for n in KINDS if kind_spec(n).softmax) == SOFTMAX_KINDS
    assert tuple(n for n in KINDS if kind_spec(n).oprf) == OPRF_KINDS


@pytest.mark.parametrize("name", list(OLD_KINDS))
def test_a_map_computes_with_its_kind_object(name: str) -> None:
    spec = kind_spec(name)
    fm = FeatureMap(4, 4 * spec.rows_per_feature if spec.random or spec.fitted else 4, kind=name)
    assert fm.spec is spec
    assert fm.is_positive == spec.positive
    assert (fm.projection is not None) == spec.random
    if spec.random:
        assert fm.projection is not None
        assert fm.projection.shape == (fm.num_features // spec.rows_per_feature, 4)
