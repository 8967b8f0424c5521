"""Random projection matrices for random-feature attention, drawn on the host.

The array API has no random numbers, so every projection is drawn with a NumPy
``Generator`` from an explicit seed and moved to the caller's device later: one
seed gives the same matrix, and the same attention output, on every backend.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["MAX_PROJECTION_SIZE", "gaussian_projection", "haar_orthogonal"]

Norms = Literal["chi", "fixed"]

#: Largest projection (entries) drawn: 2 GiB of float64.
MAX_PROJECTION_SIZE = 2**28


def haar_orthogonal(dim: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-uniform random orthogonal ``dim x dim`` matrix.

    The Q factor of a plain QR decomposition is *not* Haar-uniform: LAPACK's
    sign convention (positive diagonal of R is not enforced) biases it, and the
    resulting random-feature estimator with it.  Multiplying Q's columns by
    ``sign(diag(R))`` makes the decomposition unique and Q Haar-distributed
    (Mezzadri, 2007).

    Examples
    --------
    >>> import numpy as np
    >>> q = haar_orthogonal(4, np.random.default_rng(0))
    >>> bool(np.allclose(q @ q.T, np.eye(4)))
    True
    """
    gaussian = rng.standard_normal((dim, dim))
    q, r = np.linalg.qr(gaussian)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs[np.newaxis, :]


def gaussian_projection(
    num_rows: int,
    dim: int,
    *,
    orthogonal: bool = True,
    norms: Norms = "chi",
    seed: int = 0,
) -> np.ndarray:
    """Draw a ``(num_rows, dim)`` projection whose rows are marginally ``N(0, I_dim)``.

    Parameters
    ----------
    num_rows : int
        Number of projection rows ``omega_r``.
    dim : int
        Dimension of the vectors being projected (the head dimension).
    orthogonal : bool, default True
        Stack ``ceil(num_rows / dim)`` independent Haar-uniform orthogonal blocks
        (ORF), so rows within a block are exactly orthogonal.  ``False`` draws iid
        Gaussian rows.
    norms : {"chi", "fixed"}, default "chi"
        Row lengths.  ``"chi"`` draws them from the chi distribution with ``dim``
        degrees of freedom, so each row is exactly ``N(0, I)`` and the softmax-kernel
        estimators stay unbiased.  ``"fixed"`` sets every row to length
        ``sqrt(dim)`` (the "regularised" option: lower variance, a slightly
        different kernel).
    seed : int, default 0
        Seed of the NumPy ``Generator``; the same seed gives the same matrix.

    Returns
    -------
    numpy.ndarray
        Float64 array of shape ``(num_rows, dim)``.

    Examples
    --------
    >>> w = gaussian_projection(8, 4, seed=1)
    >>> w.shape
    (8, 4)
    >>> block = w[:4] / np.linalg.norm(w[:4], axis=1, keepdims=True)
    >>> bool(np.allclose(block @ block.T, np.eye(4)))
    True
    """
    _check_integer("num_rows", num_rows, 1)
    _check_integer("dim", dim, 1)
    if num_rows * dim > MAX_PROJECTION_SIZE:
        raise ValueError(
            f"num_rows x dim must be at most {MAX_PROJECTION_SIZE} (a "
            f"{8 * MAX_PROJECTION_SIZE // 2**30} GiB projection); got {num_rows} x {dim}"
        )
    if not isinstance(orthogonal, bool | np.bool_):
        raise TypeError(f"orthogonal must be True or False; got {orthogonal!r}")
    if norms not in ("chi", "fixed"):
        raise ValueError(f"norms must be 'chi' or 'fixed'; got {norms!r}")
    _check_integer("seed", seed, 0)
    rng = np.random.default_rng(seed)
    if orthogonal:
        num_blocks = -(-num_rows // dim)
        directions = np.concatenate([haar_orthogonal(dim, rng) for _ in range(num_blocks)])
        directions = directions[:num_rows]
        lengths = np.sqrt(rng.chisquare(dim, size=num_rows))
    else:
        gaussian = rng.standard_normal((num_rows, dim))
        lengths = np.linalg.norm(gaussian, axis=1)
        directions = gaussian / lengths[:, np.newaxis]
    if norms == "fixed":
        lengths = np.full(num_rows, np.sqrt(dim))
    return np.ascontiguousarray(directions * lengths[:, np.newaxis])


def _check_integer(name: str, value: object, low: int) -> None:
    """(``object``: the annotation says what a caller should pass, not what it did.)"""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        kind = "positive" if low == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer; got {value!r}")
