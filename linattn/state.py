"""The causal state ``(S, mu)`` of stabilised linear attention and its associative combine.

``S`` holds ``sum_j exp(l(k_j) - mu) [v_j | 1]^T`` per feature and ``mu`` the running
per-feature maximum of the key log-features, so the unstabilised sum is
``diag(exp(mu)) S``.  Every entry of ``exp(l(k_j) - mu)`` is at most 1 and, once a
feature has seen a key, its normaliser column is at least 1 (``docs/algorithm.md``, section 7).
"""

from __future__ import annotations

from dataclasses import dataclass

from linattn._xp import Array, Namespace, array_device, safe_shift

__all__ = ["LinearAttentionState", "absorb_keys", "combine", "empty_state"]


@dataclass(frozen=True, eq=False)
class LinearAttentionState:
    """Everything causal linear attention needs to continue a sequence.

    Returned by :func:`linattn.linear_attention` with ``return_state=True`` and passed
    back as ``state=`` to continue: a sequence fed whole, in pieces, or one token at a
    time gives the same outputs.

    Attributes
    ----------
    kv : array, shape ``(..., num_features, d_v + 1)``
        Stabilised sum of key features times ``[v | 1]``; the last column is the
        normaliser.
    log_shift : array, shape ``(..., num_features)``
        Per-feature running maximum ``mu`` of key log-features (``-inf`` before the
        first key).
    feature_map : str
        Fingerprint of the feature map that made the state; continuing with another
        map is an error.
    num_tokens : int
        Number of key positions absorbed so far (masked ones included).
    window : int or None
        The ``window`` the sequence runs with (``linattn.hybrid``); continuing with
        another is an error.
    sink_keys : int
        The ``sink_keys`` the sequence runs with.
    recent : (keys, values, keep) or None
        With a window ``w``: the last ``w`` keys ``(..., w, d)``, values
        ``(..., w, d_v)`` and which of them take part ``(..., w)`` (positions before the
        sequence are left out).  ``kv`` holds the random-feature state of the keys
        before them.
    sinks : (keys, values, keep) or None
        With ``sink_keys = s``: the keys and values of positions ``0 .. s - 1`` and
        which of them take part (not yet seen, or masked: left out).

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> fm = la.FeatureMap(8, 16, seed=0)
    >>> x = np.random.default_rng(0).normal(size=(6, 8))
    >>> out, state = la.linear_attention(x, x, x, fm, causal=True, return_state=True)
    >>> state.kv.shape, state.log_shift.shape, state.num_tokens
    ((16, 9), (16,), 6)

    ``combine`` (the associative combine of sequence-parallel scans) is defined on
    ``(kv, log_shift)`` only: the window and sink parts are exact, per position.
    """

    kv: Array
    log_shift: Array
    feature_map: str
    num_tokens: int = 0
    window: int | None = None
    sink_keys: int = 0
    recent: tuple[Array, Array, Array] | None = None
    sinks: tuple[Array, Array, Array] | None = None

    @property
    def value_dim(self) -> int:
        """The value dimension ``d_v`` the state was built with."""
        return int(self.kv.shape[-1]) - 1


def empty_state(
    xp: Namespace, batch_shape: tuple[int, ...], num_features: int, value_dim: int, like: Array
) -> tuple[Array, Array]:
    """``(S, mu)`` of an empty prefix: zeros and ``-inf``, dtype and device of ``like``."""
    device = array_device(like)
    kv = xp.zeros((*batch_shape, num_features, value_dim + 1), dtype=like.dtype, device=device)
    log_shift = xp.full(
        (*batch_shape, num_features), -float("inf"), dtype=like.dtype, device=device
    )
    return kv, log_shift


def absorb_keys(
    xp: Namespace,
    kv: Array,
    log_shift: Array,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
) -> tuple[Array, Array]:
    """Add a block of keys to the state: ``(S, mu) -> (S', mu')``.

    Parameters
    ----------
    kv, log_shift : arrays
        The state before, shapes ``(..., m, d_v + 1)`` and ``(..., m)``.
    log_phi_k : array, shape ``(..., C, m)``
        Key log-features of the block (``-inf`` for masked keys).
    sign_k : array or None
        Feature signs for non-positive feature maps.
    values_aug : array, shape ``(..., C, d_v + 1)``
        Values with a column of ones appended.
    """
    new_shift = xp.maximum(log_shift, xp.max(log_phi_k, axis=-2))
    safe_new = safe_shift(xp, new_shift)
    # exp(mu - mu') rescales the old sum; an empty one (mu = -inf) gets the factor
    # exp(-inf) = 0, never inf * 0.
    decay = xp.exp(log_shift - safe_new)
    phi_k = xp.exp(log_phi_k - safe_new[..., None, :])
    if sign_k is not None:
        phi_k = sign_k * phi_k
    kv = decay[..., :, None] * kv + xp.matmul(xp.matrix_transpose(phi_k), values_aug)
    return kv, new_shift


def combine(
    xp: Namespace, first: tuple[Array, Array], second: tuple[Array, Array]
) -> tuple[Array, Array]:
    """The associative combine ``(S, mu) + (S', mu')`` of two consecutive prefixes.

    ``(S e^{mu - mu*} + S' e^{mu' - mu*}, mu* = max(mu, mu'))``: what makes chunked
    prefill, incremental decoding and sequence-parallel scans one algorithm.

    Examples
    --------
    >>> import numpy as np
    >>> first = (np.ones((2, 3)), np.zeros(2))  # one key with log-feature 0 per feature
    >>> second = (np.ones((2, 3)), np.log([1.0, 3.0]))
    >>> s, mu = combine(np, first, second)
    >>> (np.exp(mu)[:, None] * s)[:, 0]  # the unstabilised sums: 1 + 1 and 1 + 3
    array([2., 4.])
    """
    kv1, mu1 = first
    kv2, mu2 = second
    top = xp.maximum(mu1, mu2)
    safe_top = safe_shift(xp, top)
    w1, w2 = xp.exp(mu1 - safe_top), xp.exp(mu2 - safe_top)
    return w1[..., :, None] * kv1 + w2[..., :, None] * kv2, top
