"""What the framework layers (:mod:`linattn.torch`, :mod:`linattn.flax`) share about the
maps they hold: the check of a fitted map given to a layer, and of its exact heads."""

from __future__ import annotations

from collections.abc import Sequence

from linattn.features import FeatureMap

__all__ = ["check_exact_heads", "exact_heads_decoding_error", "fitted_template"]


def check_exact_heads(heads: object) -> tuple[int, ...]:
    """A layer's ``exact_heads``: distinct non-negative query-head indices, sorted (their
    range is checked against the inputs' heads by :func:`linattn.with_exact_heads`).

    >>> check_exact_heads([3, 1])
    (1, 3)
    >>> check_exact_heads(2)
    Traceback (most recent call last):
    ...
    TypeError: exact_heads must be a sequence of query-head indices (e.g. (0, 5)); got 2
    """
    if not isinstance(heads, Sequence) or isinstance(heads, str):
        raise TypeError(
            f"exact_heads must be a sequence of query-head indices (e.g. (0, 5)); got {heads!r}"
        )
    if any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in heads):
        raise ValueError(f"exact_heads must be non-negative integers; got {list(heads)!r}")
    if len(set(heads)) != len(heads):
        raise ValueError(f"exact_heads must not repeat a head; got {list(heads)!r}")
    return tuple(sorted(heads))


def exact_heads_decoding_error(heads: tuple[int, ...]) -> ValueError:
    """Why a layer with exact heads does not decode (the state keeps no keys for them)."""
    return ValueError(
        f"a layer with exact heads {heads} cannot continue or return a state: the "
        "linear-attention state keeps no keys for exact attention; build the layer with "
        "exact_heads=() to decode"
    )


def fitted_template(
    feature_map: object, head_dim: int, num_features: int | None, redraw_interval: object
) -> FeatureMap:
    """``feature_map``, checked to be a fitted map the layer's other options agree with.

    >>> import numpy as np
    >>> fm = FeatureMap.fitted(np.zeros((4, 2)), tied=True)
    >>> fitted_template(fm, 4, None, None).num_features
    4
    """
    if not isinstance(feature_map, FeatureMap) or feature_map.parameters is None:
        raise TypeError(
            "feature_map must be a fitted linattn.FeatureMap (FeatureMap.fitted, "
            f"linattn.transfer.load_maps); got {feature_map!r:.80} (random maps are made by "
            "the layer from kind, num_features and seed)"
        )
    if feature_map.head_dim != head_dim:
        raise ValueError(
            f"feature_map has head_dim {feature_map.head_dim}; the layer's head_dim is {head_dim}"
        )
    if num_features is not None and num_features != feature_map.num_features:
        raise ValueError(
            f"num_features is {num_features}; feature_map has {feature_map.num_features} "
            "(leave num_features out)"
        )
    if redraw_interval is not None:
        raise ValueError(
            f"redraw_interval must be None with a fitted feature_map (nothing to redraw); "
            f"got {redraw_interval!r}"
        )
    return feature_map
