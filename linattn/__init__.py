"""linattn: Performer-style linear attention written once against the Python array API.

The same functions run on NumPy, CuPy, PyTorch, JAX, Dask and array-api-strict
arrays and return the caller's array type on the caller's device.
"""

from linattn import _jax
from linattn._dispatch import Plan, causal_plan
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
    "Plan",
    "causal_plan",
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

_jax.register_when_imported()
