"""Flax (``flax.nnx``): :class:`FastAttention`, the same attention as an nnx module.

The projection is a :class:`Projection` variable (non-trainable: ``nnx.grad`` over
``nnx.Param`` leaves it alone), saved with the module's state; a fitted map's parameters
(``feature_map=``, :mod:`linattn.fitted`) are :class:`FittedParameter` variables likewise,
or ``nnx.Param`` variables trained through :func:`linattn.jax.fitted_attention` when the
module is built with ``train_map=True``.
The feature map used under ``nnx.jit`` is static data made from it on the host, so
jitted calls see a fixed draw and only a redraw retraces; the decoding state is a pytree
(:class:`linattn.LinearAttentionState`), so it passes in and out of jitted functions.
Importing :mod:`linattn` never imports this module (or JAX, or Flax).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn._call import hybrid_options
from linattn._layer_maps import check_exact_heads, exact_heads_decoding_error, fitted_template
from linattn.attention import linear_attention, with_exact_heads
from linattn.features import FeatureMap, Kind, kind_spec
from linattn.jax import fitted_attention
from linattn.projections import gaussian_projection
from linattn.state import LinearAttentionState

__all__ = ["FastAttention", "FittedParameter", "Projection"]

#: A fitted map's parameters, one variable each (``key_*`` absent for tied maps).
FITTED = ("query_weight", "query_bias", "key_weight", "key_bias", "far_weight")


class Projection(nnx.Variable):
    """A random-feature projection: state of the module, never a trainable parameter."""


class FittedParameter(nnx.Variable):
    """A fitted map's parameter (:mod:`linattn.transfer` fits it with the model frozen):
    state of the module, never a trainable parameter."""


class FastAttention(nnx.Module):
    """Random-feature attention on ``(B, H, L, d)`` arrays (grouped key heads allowed).

    Parameters are those of :class:`linattn.torch.FastAttention` (``feature_map=`` a
    fitted map, ``window``, ``sink_keys``, ``exact_heads`` and ``train_map`` included)
    without the redraw schedule: call :meth:`redraw_projection` between (jitted) steps
    to redraw.  With ``train_map=True`` the fitted map's parameters are ``nnx.Param``
    variables (the names of the :class:`FittedParameter` ones, so states load either
    way) and every call runs :func:`linattn.jax.fitted_attention` on them, the far
    weight used as ``max(g, 0)``: ``nnx.grad`` trains them with the model's own
    parameters (on the host: see :mod:`linattn.jax`).  Decoding (``state``,
    ``return_state``) needs a module built with ``train_map=False`` from the trained
    map (:meth:`sync_projection`, then ``feature_map=module.feature_map``).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from linattn.flax import FastAttention
    >>> attention = FastAttention(8, 16, causal=True)
    >>> x = jnp.ones((1, 2, 5, 8))
    >>> attention(x, x, x).shape
    (1, 2, 5, 8)

    A fitted map, one per head, with a window and a sink:

    >>> import numpy as np
    >>> import linattn as la
    >>> fm = la.FeatureMap.fitted(np.zeros((2, 8, 4)), tied=True, far_weight=0.5)
    >>> FastAttention(8, feature_map=fm, window=2, sink_keys=1)(x, x, x).shape
    (1, 2, 5, 8)

    The same map trained (``nnx.grad`` reaches its parameters):

    >>> from flax import nnx
    >>> layer = FastAttention(8, feature_map=fm, window=2, sink_keys=1, train_map=True)
    >>> grads = nnx.grad(lambda m: m(x, x, x).sum())(layer)
    >>> grads["query_weight"][...].shape
    (2, 8, 4)
    """

    def __init__(
        self,
        head_dim: int,
        num_features: int | None = None,
        *,
        kind: Kind | None = None,
        feature_map: FeatureMap | None = None,
        causal: bool = False,
        window: int | None = None,
        sink_keys: int = 0,
        seed: int = 0,
        orthogonal: bool = True,
        scale: float | None = None,
        rebalance: bool | None = None,
        chunk_size: int | None = None,
        train_map: bool = False,
        exact_heads: Sequence[int] = (),
    ) -> None:
        self.exact_heads = check_exact_heads(exact_heads)
        if not isinstance(train_map, bool):
            raise TypeError(f"train_map must be True or False; got {train_map!r}")
        kind = kind if kind is not None else ("hyperbolic" if causal else "hyperbolic_oprf")
        rebalance = (not causal) if rebalance is None else rebalance
        if feature_map is not None:
            self.feature_map = fitted_template(feature_map, head_dim, num_features, None)
        else:
            self.feature_map = FeatureMap(
                head_dim,
                256 if num_features is None else num_features,
                kind=kind,
                orthogonal=orthogonal,
                scale=scale,
                seed=seed,
                rebalance=rebalance and kind_spec(kind).random,
            )
        self.causal, self.seed, self.chunk_size, self.draws = causal, seed, chunk_size, 0
        self.hybrid = hybrid_options(window=window, sink_keys=sink_keys)
        projection = self.feature_map.projection
        self.projection = Projection(
            jnp.zeros((0, head_dim)) if projection is None else jnp.asarray(projection)
        )
        parameters = self.feature_map.parameters
        self.fitted = parameters is not None
        if train_map and not self.fitted:
            raise ValueError(
                f"train_map=True needs a fitted map (feature_map= or kind='hedgehog'); got "
                f"kind={self.feature_map.kind!r}"
            )
        self.train_map = train_map
        variable = nnx.Param if train_map else FittedParameter
        for name, value in ({} if parameters is None else parameters.arrays()).items():
            setattr(self, name, variable(jnp.asarray(value)))

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
        if self.exact_heads and (state is not None or return_state):
            raise exact_heads_decoding_error(self.exact_heads)
        if self.train_map:
            out = self._train_map_call(q, k, v, key_mask, state, return_state)
        else:
            out = linear_attention(
                q,
                k,
                v,
                self.feature_map,
                causal=self.causal,
                key_mask=key_mask,
                state=state,
                return_state=return_state,
                chunk_size=self.chunk_size,
                **self.hybrid,
            )
        if not self.exact_heads:
            return out
        return with_exact_heads(
            out, q, k, v, self.exact_heads, causal=self.causal, key_mask=key_mask,
            scale=self.feature_map.scale,
        )  # fmt: skip

    def _train_map_call(
        self, q: Any, k: Any, v: Any, key_mask: Any, state: Any, return_state: bool
    ) -> Any:
        """:func:`linattn.jax.fitted_attention` on the ``nnx.Param`` variables."""
        if state is not None or return_state:
            raise ValueError(
                "state and return_state need a module built with train_map=False: call "
                "sync_projection(), then FastAttention(..., feature_map=module.feature_map); "
                f"got state={'given' if state is not None else None}, "
                f"return_state={return_state!r}"
            )
        values = {name: getattr(self, name).get_value() for name in FITTED if hasattr(self, name)}
        values["far_weight"] = jnp.maximum(values["far_weight"], 0.0)
        return fitted_attention(
            q,
            k,
            v,
            **values,
            tied="key_weight" not in values,
            causal=self.causal,
            key_mask=key_mask,
            scale=self.feature_map.scale,
            chunk_size=self.chunk_size,
            **self.hybrid,
        )

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
        """Rebuild the feature map from the variables (after restoring a checkpoint)."""
        fm = self.feature_map
        if self.fitted:
            host = {
                name: np.asarray(getattr(self, name).get_value(), dtype=np.float64)
                for name in FITTED
                if hasattr(self, name)
            }
            tied = "key_weight" not in host
            self.feature_map = FeatureMap.fitted(**host, tied=tied, scale=fm.scale)
            return
        if fm.projection is None:
            return
        adopted = FeatureMap.from_projection(
            np.asarray(self.projection.get_value(), dtype=np.float64),
            kind=fm.kind,
            scale=fm.scale,
        )
        self.feature_map = adopted.replace(rebalance=fm.rebalance)
