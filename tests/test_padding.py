"""Padding is inert: NaN, inf or 1e300 in a padded query, key or value never changes a
real row, on every path a padded call takes (NumPy's executors, torch's and JAX's
fitted forms, dense and library).

On the commit before, the fitted dense form (torch and JAX, the default for short
self-attention) moved real rows by 1.2 to 2.6 for NaN or inf in a padded key and turned
every real row of the batch into NaN for one in a padded value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import linattn as la

# (NumPy warns of the padded rows' own NaN arithmetic: those rows are the caller's.)
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning"
)

RNG = np.random.default_rng(3)
#: Two sequences of 6 tokens, the first padded after 4; 2 heads, d = 4.
Q, K, V = (RNG.standard_normal((2, 2, 6, 4)) for _ in range(3))
MASK = np.array([[True] * 4 + [False] * 2, [True] * 6])[:, None, :]
WEIGHT = RNG.standard_normal((2, 4, 4)) * 0.5
FITTED = la.FeatureMap.fitted(WEIGHT, tied=True, far_weight=0.7)
RANDOM = la.FeatureMap(4, 16, kind="hyperbolic", seed=0)
POISON = [np.nan, np.inf, -np.inf, 1e300]
#: The calls' options: plain, causal, window + sinks (causal and not).
OPTIONS = [
    {},
    {"causal": True},
    {"window": 2, "sink_keys": 1},
    {"causal": True, "window": 2, "sink_keys": 1},
]


def _poisoned(which: str, value: float) -> tuple[np.ndarray, ...]:
    arrays = {"q": Q.copy(), "k": K.copy(), "v": V.copy()}
    arrays[which][0, :, 4:, :] = value
    return arrays["q"], arrays["k"], arrays["v"]


def _real_rows(out: Any) -> np.ndarray:
    """The rows of real tokens: all of the second sequence, the first 4 of the first."""
    out = np.asarray(out)
    return np.concatenate([out[0, :, :4].ravel(), out[1].ravel()])


def _check(attend: Any) -> None:
    for options in OPTIONS:
        clean = _real_rows(attend(Q, K, V, options))
        assert np.isfinite(clean).all()
        for which in "qkv":
            for value in POISON:
                got = _real_rows(attend(*_poisoned(which, value), options))
                np.testing.assert_allclose(
                    got, clean, rtol=1e-12, atol=1e-12,
                    err_msg=f"{value} in a padded {which}, {options}",
                )  # fmt: skip


@pytest.mark.parametrize("feature_map", [FITTED, RANDOM], ids=["fitted", "random"])
@pytest.mark.parametrize("backend", ["auto", "array_api"])
def test_numpy(feature_map: la.FeatureMap, backend: str) -> None:
    _check(
        lambda q, k, v, options: la.linear_attention(
            q, k, v, feature_map, key_mask=MASK, backend=backend, **options
        )
    )


@pytest.mark.parametrize("dense", [True, False])
def test_torch_fitted_attention(dense: bool) -> None:
    torch = pytest.importorskip("torch")
    from linattn.torch import fitted_attention

    weight = torch.from_numpy(WEIGHT)
    mask = torch.from_numpy(MASK)

    def attend(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Any:
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
        out = fitted_attention(
            q, k, v, weight, tied=True, far_weight=0.7, key_mask=mask, dense=dense, **options
        )
        return out.numpy()

    _check(attend)


def test_jax_fitted_attention() -> None:
    jax = pytest.importorskip("jax")
    from linattn.jax import fitted_attention

    def attend(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Any:
        q, k, v = (jax.numpy.asarray(x) for x in (q, k, v))
        return fitted_attention(
            q, k, v, jax.numpy.asarray(WEIGHT), tied=True, far_weight=0.7,
            key_mask=jax.numpy.asarray(MASK), **options,
        )  # fmt: skip

    x64 = jax.config.jax_enable_x64  # (float64 here; the session's setting restored after)
    jax.config.update("jax_enable_x64", True)
    try:
        _check(attend)
    finally:
        jax.config.update("jax_enable_x64", x64)
