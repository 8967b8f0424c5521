"""Flax (``flax.nnx``): :class:`FastAttention`, the same attention as an nnx module.

The projection is a :class:`Projection` variable (non-trainable: ``nnx.grad`` over
``nnx.Param`` leaves it alone), saved with the module's state.  The feature map used
under ``nnx.jit`` is static data made from it on the host, so jitted calls see a fixed
draw and only a redraw retraces; the decoding state is a pytree
(:class:`linattn.LinearAttentionState`), so it passes in and out of jitted functions.
Importing :mod:`linattn` never imports this module (or JAX, or Flax).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn._gqa import grouped
from linattn.attention import linear_attention
from linattn.features import KINDS, FeatureMap, Kind
from linattn.projections import gaussian_projection
from linattn.state import LinearAttentionState

__all__ = ["FastAttention", "Projection"]


class Projection(nnx.Variable):
    """A random-feature projection: state of the module, never a trainable parameter."""


class FastAttention(nnx.Module):
    """Random-feature attention on ``(B, H, L, d)`` arrays (grouped key heads allowed).

    Parameters are those of :class:`linattn.torch.FastAttention` without the redraw
    schedule: call :meth:`redraw_projection` between (jitted) steps to redraw.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from linattn.flax import FastAttention
    >>> attention = FastAttention(8, 16, causal=True)
    >>> x = jnp.ones((1, 2, 5, 8))
    >>> attention(x, x, x).shape
    (1, 2, 5, 8)
    """

    def __init__(
        self,
        head_dim: int,
        num_features: int = 256,
        *,
        kind: Kind | None = None,
        causal: bool = False,
        seed: int = 0,
        orthogonal: bool = True,
        scale: float | None = None,
        rebalance: bool | None = None,
        chunk_size: int | None = None,
    ) -> None:
        kind = kind if kind is not None else ("hyperbolic" if causal else "hyperbolic_oprf")
        rebalance = (not causal) if rebalance is None else rebalance
        self.feature_map = FeatureMap(
            head_dim,
            num_features,
            kind=kind,
            orthogonal=orthogonal,
            scale=scale,
            seed=seed,
            rebalance=rebalance and KINDS[kind][0],
        )
        self.causal, self.seed, self.chunk_size, self.draws = causal, seed, chunk_size, 0
        projection = self.feature_map.projection
        self.projection = Projection(
            jnp.zeros((0, head_dim)) if projection is None else jnp.asarray(projection)
        )

    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        key_mask: Any = None,
        state: LinearAttentionState | None = None,
        return_state: bool = False,
    ) -> Any:
        """As :meth:`linattn.torch.FastAttention.forward` (``key_mask`` ``(B, L_k)`` or
        broadcasting against ``(B, H, L_k)``)."""
        if key_mask is not None and key_mask.ndim == 2 and q.ndim == 4:
            key_mask = key_mask[:, None, :]
        q, k, v, key_mask, ungroup = grouped(q, k, v, key_mask)
        result = linear_attention(
            q,
            k,
            v,
            self.feature_map,
            causal=self.causal,
            key_mask=key_mask,
            state=state,
            return_state=return_state,
            chunk_size=self.chunk_size,
        )
        if return_state:
            out, new_state = result
            return ungroup(out), new_state
        return ungroup(result)

    def redraw_projection(self) -> None:
        """Draw the next projection, from ``seed + draws + 1`` (host code: not under jit)."""
        fm = self.feature_map
        if fm.projection is None:
            return
        self.draws += 1
        fresh = gaussian_projection(
            fm.projection.shape[0],
            fm.head_dim,
            orthogonal=fm.orthogonal,
            seed=self.seed + self.draws,
        )
        self.projection.set_value(jnp.asarray(fresh))
        self.sync_projection()

    def sync_projection(self) -> None:
        """Rebuild the feature map from the variable (after restoring a checkpoint)."""
        fm = self.feature_map
        if fm.projection is None:
            return
        adopted = FeatureMap.from_projection(
            np.asarray(self.projection.get_value(), dtype=np.float64),
            kind=fm.kind,
            scale=fm.scale,
        )
        self.feature_map = adopted._replace(rebalance=fm.rebalance)
