"""What the framework layers (:mod:`linattn.torch`, :mod:`linattn.flax`) share about the
maps they hold: the check of a fitted map given to a layer."""

from __future__ import annotations

from linattn.features import FeatureMap

__all__ = ["fitted_template"]


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
