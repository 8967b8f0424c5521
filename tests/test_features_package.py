"""``linattn.features`` as a package: every name it exported as a module is still there,
and the map's kind object and copies have public names."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import numpy as np
import pytest

import linattn as la
import linattn.features

PACKAGE = Path(linattn.features.__file__).parent

#: The public names ``linattn/features.py`` defined or imported before it became a
#: package (0.1.0).
FORMER_NAMES = [
    "FeatureKind",
    "FeatureMap",
    "KINDS",
    "KIND_SPECS",
    "Kind",
    "MIN_OPRF_A",
    "OPRF_KINDS",
    "Role",
    "SOFTMAX_KINDS",
    "feature_map_for",
    "kind_spec",
    "overflow_limit",
]


@pytest.mark.parametrize("name", FORMER_NAMES)
def test_every_former_name_is_importable(name: str) -> None:
    assert hasattr(linattn.features, name)
    assert name in linattn.features.__all__


def test_only_the_map_module_reads_a_maps_private_fields() -> None:
    """The other modules of the package read a map's public properties (``spec``,
    ``projection``, ``parameters``, ...), never its private fields."""
    for path in PACKAGE.glob("*.py"):
        if path.name == "map.py":
            continue
        tree = ast.parse(path.read_text())
        private = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in {"fm", "feature_map"}
            and node.attr.startswith("_")
        }
        assert not private, (path.name, private)


def test_spec_is_the_kind_object() -> None:
    fm = la.FeatureMap(8, 16, kind="hyperbolic")
    assert fm.spec is linattn.features.kind_spec("hyperbolic")
    assert fm.spec.fused and fm.spec.rows_per_feature == 2


def test_replace_rebuilds_a_checked_map() -> None:
    fm = la.FeatureMap.from_projection(np.eye(4))
    rebalanced = fm.replace(rebalance=True)
    assert rebalanced.rebalance and rebalanced.needs_calibration and not fm.rebalance
    np.testing.assert_array_equal(rebalanced.projection, fm.projection)
    assert rebalanced.fingerprint != fm.fingerprint
    assert fm.replace(scale=0.25).scale == 0.25
    oprf = la.FeatureMap(4, 8, kind="oprf")
    assert oprf.replace(oprf_a=-0.1).oprf_a == -0.1
    assert oprf.replace().fingerprint == oprf.fingerprint


def test_replace_refuses_what_must_agree_with_the_projection() -> None:
    fm = la.FeatureMap(4, 8)
    for name, value in (("head_dim", 5), ("kind", "elu"), ("projection", np.eye(4))):
        with pytest.raises(TypeError, match=f"replace takes scale, .*unknown names \\['{name}'"):
            fm.replace(**{name: value})
    with pytest.raises(ValueError, match="rebalance=True needs a softmax-estimating kind"):
        la.FeatureMap(4, 4, kind="elu").replace(rebalance=True)
    with pytest.raises(ValueError, match="oprf_a applies to kinds"):
        fm.replace(oprf_a=-0.1)


@pytest.mark.parametrize("kind", ["oprf", "hedgehog"])
def test_pickling_and_the_registry_survive_the_move(kind: str) -> None:
    fm = la.FeatureMap(4, 8, kind=kind, rebalance=kind == "oprf")
    if fm.needs_calibration:
        rng = np.random.default_rng(0)
        fm = fm.calibrate(rng.normal(size=(16, 4)), rng.normal(size=(16, 4)))
    copy = pickle.loads(pickle.dumps(fm))
    assert copy.fingerprint == fm.fingerprint and repr(copy) == repr(fm)
    assert linattn.features.feature_map_for(fm.fingerprint) is not None
    x = np.random.default_rng(1).normal(size=(3, 4))
    np.testing.assert_array_equal(copy.log_features(x, role="key"), fm.log_features(x, role="key"))
