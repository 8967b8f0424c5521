"""Feature maps: queries and keys to (log-)features whose inner products estimate a kernel.

Every map works in **log-features** ``l(x) = log phi(x)``: the attention code takes
log-features and does all stabilisation there (``docs/algorithm.md``, sections
2, 3 and 5).  What differs between kinds lives in :mod:`linattn.features.kinds`, one
object per kind.

The package, by topic (each module imports only those after it):

- :mod:`linattn.features.map`: :class:`FeatureMap` itself (fields, construction, copies,
  pickling, its public methods) and :func:`feature_map_for`;
- :mod:`linattn.features.checks`: the checks of a map's arguments and fields, its
  fingerprint;
- :mod:`linattn.features.compute`: log-features and their VJP from a map (the scaled,
  rebalanced input, overflowing rows);
- :mod:`linattn.features.statistics`: OPRF's ``A`` and the rebalancing ``Psi``
  (calibration and their checks);
- :mod:`linattn.features.kinds`: one object per kind (:data:`KIND_SPECS`,
  :func:`kind_spec`) and the kind names (:data:`Kind`, :data:`KINDS`, ...);
- :mod:`linattn.features.registry`: weak references to the live maps by fingerprint.
"""

from linattn.features.compute import Role, overflow_limit
from linattn.features.kinds import (
    KIND_SPECS,
    KINDS,
    OPRF_KINDS,
    SOFTMAX_KINDS,
    FeatureKind,
    Kind,
    kind_spec,
)
from linattn.features.map import FeatureMap, feature_map_for
from linattn.features.statistics import MIN_OPRF_A

__all__ = [
    "KINDS",
    "KIND_SPECS",
    "MIN_OPRF_A",
    "OPRF_KINDS",
    "SOFTMAX_KINDS",
    "FeatureKind",
    "FeatureMap",
    "Kind",
    "Role",
    "feature_map_for",
    "kind_spec",
    "overflow_limit",
]
