"""The hybrid of a short self-attention call with a fitted map, as ``L x L`` weights per
head in matrix products instead of scans (``docs/algorithm.md``, section 18).

Up to a few hundred tokens the hybrid's work is about exact attention's, and its scans
and banded loops run far below the speed of a matrix product.  Here both parts are
dense:

- the near keys (window, sinks, exact keys): exact softmax attention over them and its
  log-sum-exp (torch's fused attention kernel on CPU tensors,
  :func:`linattn._xp.fused_softmax_lse`; the array API elsewhere);
- the far keys (every other real key, and, causal, none after the query):
  ``g phi(q_i) . phi(k_j)`` as one product of the features, the near and hidden keys'
  entries zeroed, times ``v``; their sum is the far part's mass.

The parts merge as every hybrid's do, at the larger of their two log-scales.  A fitted
map's features are a softmax (entries in ``[0, 1]``, the largest at least ``1/m``), so
they need no stabiliser of their own: only ``log g`` is kept apart, in the far part's
log-scale.  (As in the log-domain dense form this replaced, a far weight below the
float's range, a query and a key whose features overlap only where both are below
``1e-38`` in float32, is lost; the scans, which stabilise each feature over the keys,
keep it, and it matters only to a row whose near part is as small.)  Random maps, whose
log-features grow with a key's norm, keep the scans.

Which calls run here is decided in one place, :func:`why_not` (the limits of
:func:`max_length`).
"""

from __future__ import annotations

import math
from typing import Any

from linattn import fitted
from linattn._xp import (
    Array,
    Namespace,
    array_device,
    constant,
    fused_softmax_attention,
    fused_softmax_lse,
    safe_shift,
    softmax,
    stop_gradient,
)
from linattn.features import FeatureMap
from linattn.hybrid.build import ExactParts

__all__ = [
    "BLOCK_ELEMENTS",
    "CAUSAL_MAX_LENGTH",
    "MAX_LENGTH",
    "dense_attention",
    "hybrid_from_features",
    "max_length",
    "near_and_far",
    "why_not",
]

#: The longest bidirectional self-attention the plan gives the dense form, per kind of
#: call, measured on MiniLM's shape (batch 8, 12 heads, d = 32, m = 64, window 16 + 1
#: sink, the last batch row a quarter padded), one run each on this project's 2-core
#: CPU (``python benchmarks/dense_hybrid_speed.py``, ``--grad``, ``--jax``):
#:
#: - ``"torch"``: torch CPU tensors, no gradient (an exact key per row too), against the
#:   one-pass hybrid kernels: they took 4.1x / 2.9x / 1.6x / 1.2x / 1.2x the dense
#:   form's time at 64 / 128 / 256 / 384 / 512 tokens;
#: - ``"torch-grad"``: the same, forward and backward in q, k and v (the kernels' custom
#:   operators' backward against autograd through the dense form, ``--grad``): they took
#:   10.4x / 7.8x / 4.7x / 3.2x / 2.6x the dense form's time at 64 / 128 / 256 / 384 /
#:   512 tokens; autograd keeps several ``L x L`` arrays per head until the backward
#:   pass (peak resident memory at 512 tokens 1.2 GiB against the kernels' 0.76 GiB);
#: - ``"jax"``: JAX arrays, jitted, against the portable parts: 3.9x / 1.9x / 1.4x /
#:   1.1x / 0.92x the dense form's forward time at 128 / 192 / 256 / 384 / 512 tokens,
#:   2.6x / 2.1x / 1.8x / 1.3x / 0.95x its gradient's.
#:
#: The dense form holds ``L x L`` weights per head, in blocks of batch rows
#: (:data:`BLOCK_ELEMENTS`) where nothing is differentiated.
#:
#: - ``"parameters"``: :func:`linattn.torch.fitted_attention` and
#:   :func:`linattn.jax.fitted_attention` with the map's parameters as differentiable
#:   arrays (``dense=None``), against the library's path with parameter cotangents
#:   (forward and backward in every input and parameter, MiniLM's shape, one run): it took
#:   4.5x / 2.4x / 2.0x / 1.05x the dense form's time at 128 / 256 / 320 / 384 tokens,
#:   0.81x at 512 (``benchmarks/refine_attention_speed.py --lengths 128 256 320 384
#:   512``).
#:
#: - ``"torch-near"``: no feature map (the window, sinks and exact keys alone), torch CPU
#:   tensors, no gradient, against the same call on the kernels (window 16 + 4 sinks + 2
#:   exact keys per row, MiniLM's shape): the kernels took 2.7x / 2.8x / 2.1x / 1.2x /
#:   1.45x / 1.27x / 0.94x / 0.75x the dense form's time at 64 / 128 / 256 / 288 / 320 /
#:   352 / 384 / 512 tokens (one run each).
MAX_LENGTH = {"torch": 512, "torch-grad": 512, "jax": 384, "parameters": 384, "torch-near": 352}

#: The same for causal calls, whose dense form computes the weights after each query too
#: (and zeroes them).  torch: the kernels took 1.5x / 1.3x / 1.3x / 1.0x / 0.84x the
#: dense form's time at 128 / 160 / 192 / 224 / 256 tokens (``--only-causal --lengths
#: 128 160 192 224 256``); with a gradient 6.1x / 4.5x / 3.5x / 1.8x / 1.5x at 64 / 128
#: / 192 / 384 / 512 (peak memory at 512 tokens 1.6 GiB against 0.74 GiB); JAX: the
#: parts took 1.64x / 1.01x / 1.0x its forward time at 128 / 192 / 256 tokens, 1.51x /
#: 1.32x / 0.99x its gradient's (``--jax --causal``).  ``"torch-near"``: the kernels took
#: 2.2x / 2.0x / 1.5x / 1.45x / 1.42x / 0.88x / 0.74x the dense form's time at 64 / 128 /
#: 256 / 288 / 320 / 384 / 512 tokens.
CAUSAL_MAX_LENGTH = {
    "torch": 192, "torch-grad": 512, "jax": 192, "parameters": 384, "torch-near": 320,
}  # fmt: skip

#: About how many ``L x L`` weights the dense form holds at once: rows of the batch are
#: computed in blocks of at most this many weights (at least one row), which keeps the
#: block's weights in cache.  1M float32 weights (4 MiB) was the fastest measured in one
#: interleaved run of MiniLM-sized calls (batch 8, 12 heads): 12.4 / 33.0 ms at 128 / 256
#: tokens against 2^22's 14.6 / 39.5 ms, the same at 384 and 512 (2^19 and 2^21 slower or
#: equal).
BLOCK_ELEMENTS = 1 << 20


def max_length(causal: bool, kind: str) -> int:
    """The longest self-attention given the dense form for a ``kind`` of call
    (``"torch"``, ``"torch-grad"``, ``"jax"``, ``"parameters"`` or ``"torch-near"``):
    :data:`MAX_LENGTH` and :data:`CAUSAL_MAX_LENGTH`."""
    return (CAUSAL_MAX_LENGTH if causal else MAX_LENGTH)[kind]


def why_not(causal: bool, kind: str, query_length: int, key_length: int) -> str | None:
    """Why the dense form does not serve a fitted hybrid call of these lengths (else
    ``None``): the one place that decides dense form or scans, for the plan's
    ``dense-hybrid`` executor and for :func:`linattn.torch.fitted_attention` /
    :func:`linattn.jax.fitted_attention` (``kind="parameters"``).

    Examples
    --------
    >>> why_not(False, "torch", 128, 128) is None
    True
    >>> why_not(True, "torch", 300, 300)
    'not causal self-attention of at most 192 tokens'
    """
    limit = max_length(causal, kind)
    if key_length != query_length or query_length > limit:
        what = ("causal " if causal else "") + "self-attention"
        note = " with a gradient" if kind == "torch-grad" else ""
        return f"not {what} of at most {limit} tokens{note}"
    return None


def dense_attention(
    xp: Namespace,
    q: Array,
    k: Array,
    v: Array,
    key_mask: Array | None,
    exact: ExactParts,
    feature_map: FeatureMap | None,
    *,
    causal: bool,
    scale: float,
) -> Array:
    """The output of a self-attention hybrid call (a query that sees no key: zeros).

    ``q``, ``k``, ``v`` are broadcast to one batch shape ``(..., L, .)`` (masked keys
    zeroed, as :func:`linattn._call.check_exact_call` leaves them); ``key_mask``
    (broadcasting against ``(..., L)``; None: every key) says which keys are real;
    ``exact`` holds the window, the sinks and the exact keys; ``feature_map`` is a
    fitted map or None (the near keys alone).

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.hybrid.build import ExactParts
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(2, 6, 4)) for _ in range(3))
    >>> fm = la.FeatureMap.fitted(np.eye(4)[:, :2], tied=True, far_weight=0.5)
    >>> out = dense_attention(np, q, k, v, None, ExactParts(2, 1, None), fm, causal=False,
    ...                       scale=fm.scale)
    >>> bool(np.allclose(out, la.linear_attention(q, k, v, fm, window=2, sink_keys=1)))
    True
    """
    batch = q.shape[:-2]
    per_row = 1
    for n in batch[1:]:
        per_row *= n
    step = max(1, BLOCK_ELEMENTS // (per_row * q.shape[-2] ** 2))
    # In blocks of batch rows, each one call of this (the near keys alone hold no weights:
    # the fused kernel blocks them itself).
    if feature_map is not None and len(batch) and batch[0] > step:

        def rows_of(mask: Array | None, rows: slice) -> Array | None:  # (may broadcast)
            if mask is None or mask.ndim < len(batch) + 1 or mask.shape[0] == 1:
                return mask
            return mask[rows, ...]

        blocks = []
        for start in range(0, batch[0], step):
            rows = slice(start, start + step)
            part = ExactParts(exact.window, exact.sink_keys, rows_of(exact.exact_key_mask, rows))
            block = (q[rows, ...], k[rows, ...], v[rows, ...], rows_of(key_mask, rows))
            out = dense_attention(xp, *block, part, feature_map, causal=causal, scale=scale)
            blocks.append(out)
        return xp.concat(blocks, axis=0)
    mask = exact.exact_key_mask
    near, far = near_and_far(
        xp, q.shape[-2], array_device(q), causal=causal, window=exact.window,
        sink_keys=exact.sink_keys, real=None if key_mask is None else key_mask[..., None, :],
        exact=None if mask is None else mask[..., None, :],
    )  # fmt: skip
    p = None if feature_map is None else feature_map.parameters
    if p is None:  # (no log-sum-exp needed: torch's attention where it serves)
        fused = fused_softmax_attention(xp, q, k, v, near, scale)
        return _softmax_lse(xp, q, k, v, near, scale)[0] if fused is None else fused
    phi_q = softmax(xp, fitted.pairs_projection(xp, p, q, "query"))
    phi_k = softmax(xp, fitted.pairs_projection(xp, p, k, "key"))
    log_g = fitted.far_log_shift(xp, p, k, zero=-math.inf)  # g = 0: no far part at all
    log_g = log_g if isinstance(log_g, float) else log_g[..., 0]  # against (..., L)
    return hybrid_from_features(xp, q, k, v, phi_q, phi_k, log_g, near, far, scale)


def near_and_far(
    xp: Namespace,
    length: int,
    device: Any,
    *,
    causal: bool,
    window: int | None,
    sink_keys: int,
    real: Array | None,
    exact: Array | None,
    queries: Array | None = None,
) -> tuple[Array, Array]:
    """Which keys each of ``length`` queries weighs exactly and which through the map.

    Near keys: the window (``|t - j| < window``), the first ``sink_keys`` keys and the
    ``exact`` keys; far keys: every other key that is ``real`` (and, ``causal``, not
    after the query).  ``real`` and ``exact`` are boolean masks broadcasting against
    ``(..., L_q, L_k)`` (a query axis before the keys'), or None (every key real; no
    exact keys).  ``queries``: the positions of the query rows (integers; default all
    ``length``).  Returns ``(near, far)``, disjoint boolean masks.
    """
    t = (xp.arange(length, device=device) if queries is None else queries)[:, None]
    j = xp.arange(length, device=device)[None, :]
    rows = length if queries is None else int(queries.shape[0])
    seen = (j <= t) if causal else xp.ones((rows, length), dtype=xp.bool, device=device)
    near = (j < sink_keys) & seen
    if window is not None:
        near = near | (seen & (xp.abs(t - j) < window))
    if real is None:
        real = xp.ones((1, length), dtype=xp.bool, device=device)
    near = near & real
    if exact is not None:
        near = near | (exact & real & seen)
    return near, seen & real & ~near


def hybrid_from_features(
    xp: Namespace,
    q: Array,
    k: Array,
    v: Array,
    phi_q: Array,
    phi_k: Array,
    log_g: Array | float,
    near: Array,
    far: Array,
    scale: float,
) -> Array:
    """``(N_near + g N_far) / (D_near + g D_far)`` from the features, dense, and
    differentiable by the caller's framework in every argument but the masks.

    ``phi_q`` ``(..., L, m)`` and ``phi_k`` are a normalised map's features (entries in
    ``[0, 1]``); ``log_g`` broadcasts against ``(..., L)`` (``-inf``: no far part, the
    near keys alone, and no gradient); ``near`` and ``far`` are disjoint boolean masks
    against ``(..., L, L)`` (:func:`near_and_far`).  A query that sees no key outputs
    zeros.  The near part runs torch's fused attention kernel where it serves
    (:func:`linattn._xp.fused_softmax_lse`), the array API's softmax elsewhere.
    """
    near_out, near_lse = _softmax_lse(xp, q, k, v, near, scale)
    # (a product by the mask: the features are finite, and selecting is slower on CPUs)
    products = xp.matmul(phi_q, xp.matrix_transpose(phi_k)) * xp.astype(far, phi_q.dtype)
    far_sum = xp.sum(products, axis=-1)
    ones = xp.ones_like(far_sum)
    if isinstance(log_g, float):
        has_far = far_sum > 0 if log_g > -math.inf else xp.zeros_like(far_sum, dtype=xp.bool)
        safe_log_g: Array | float = log_g if log_g > -math.inf else 0.0
    else:
        has_far = (far_sum > 0) & (log_g > -math.inf)
        safe_log_g = xp.where(has_far, log_g, constant(xp, 0.0, far_sum))
    far_lse = xp.where(
        has_far, xp.log(xp.where(has_far, far_sum, ones)) + safe_log_g,
        constant(xp, -math.inf, far_sum),
    )  # fmt: skip
    top = stop_gradient(xp, safe_shift(xp, xp.maximum(near_lse, far_lse)))
    near_weight = xp.exp(near_lse - top)[..., None]
    far_weight = xp.exp(far_lse - top)[..., None]  # ... per unit of far_sum:
    far_scale = far_weight / xp.where(has_far, far_sum, ones)[..., None]
    numerator = near_out * near_weight + xp.matmul(products, v) * far_scale
    denominator = near_weight + far_weight  # >= 1 where a query sees a key
    seen = denominator > 0
    safe = xp.where(seen, denominator, xp.ones_like(denominator))
    return xp.where(seen, numerator / safe, constant(xp, 0.0, numerator))


def _softmax_lse(
    xp: Namespace, q: Array, k: Array, v: Array, visible: Array, scale: float
) -> tuple[Array, Array]:
    """Exact attention over the ``visible`` keys and its log-sum-exp (a query that sees
    no key: zeros and ``-inf``), by a fused kernel where one serves."""
    fused = fused_softmax_lse(xp, q, k, v, visible, scale)
    if fused is not None:
        return fused
    logits = xp.matmul(q, xp.matrix_transpose(k)) * scale
    logits = xp.where(visible, logits, constant(xp, -math.inf, logits))
    top = stop_gradient(xp, safe_shift(xp, xp.max(logits, axis=-1)))
    weights = xp.exp(logits - top[..., None])
    total = xp.sum(weights, axis=-1)
    seen = total > 0
    safe = xp.where(seen, total, xp.ones_like(total))
    lse = xp.where(seen, xp.log(safe) + top, constant(xp, -math.inf, total))
    return xp.matmul(weights, v) / safe[..., None], lse
