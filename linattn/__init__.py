"""linattn: Performer-style linear attention written once against the Python array API.

The same functions run on NumPy, CuPy, PyTorch, JAX, Dask and array-api-strict
arrays and return the caller's array type on the caller's device.
"""

import warnings
from typing import Any

from linattn import _dispatch, _jax
from linattn._plan import AttentionPlan, plan_attention
from linattn.attention import (
    favor_attention,
    linear_attention,
    softmax_attention,
    with_exact_heads,
)
from linattn.features import KINDS, FeatureMap
from linattn.projections import gaussian_projection
from linattn.state import LinearAttentionState, combine
from linattn.vjp import linear_attention_vjp

__all__ = [
    "KINDS",
    "AttentionPlan",
    "FeatureMap",
    "LinearAttentionState",
    "combine",
    "favor_attention",
    "gaussian_projection",
    "linear_attention",
    "linear_attention_vjp",
    "plan_attention",
    "softmax_attention",
    "with_exact_heads",
]

__version__ = "0.1.0"

#: Public names kept for one release, each with what replaces it.
_DEPRECATED = {
    "causal_plan": "plan_attention(q, k, v, feature_map, causal=True).scan",
    "Plan": "the type of AttentionPlan.scan (plan_attention(...).scan)",
}


def __getattr__(name: str) -> Any:
    """``causal_plan`` and ``Plan``: deprecated aliases of the scan plan that
    :func:`plan_attention` returns as its ``scan`` (one plan concept for users)."""
    if name in _DEPRECATED:
        warnings.warn(
            f"linattn.{name} is deprecated and goes in the next release: use {_DEPRECATED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_dispatch, name)
    raise AttributeError(f"module 'linattn' has no attribute {name!r}")


_jax.register_when_imported()
