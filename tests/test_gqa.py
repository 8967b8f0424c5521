"""Grouped-query attention: H_kv key/value heads serve H query heads, without copies.

Reference: the same call with keys and values repeated per query head (``np.repeat``
along the head axis, what Llama's ``repeat_kv`` does), in float64 on every backend.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Backend, assert_close

import linattn as la
from linattn._gqa import grouped

B, H, H_KV, L, D = 2, 6, 2, 24, 8
FM = la.FeatureMap(D, 16, kind="hyperbolic", seed=3)


def _inputs(heads_kv: int = H_KV) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    q = 0.5 * rng.normal(size=(B, H, L, D))
    k, v = (0.5 * rng.normal(size=(B, heads_kv, L, D)) for _ in range(2))
    keep = np.ones((B, 1, L), dtype=bool)
    keep[1, 0, -5:] = False  # padding in the second sequence
    return q, k, v, keep


def _repeated(x: np.ndarray) -> np.ndarray:
    return np.repeat(x, H // x.shape[-3], axis=-3)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_equals_repeated_keys(backend: Backend, causal: bool) -> None:
    q, k, v, keep = _inputs()
    expected = la.linear_attention(q, _repeated(k), _repeated(v), FM, causal=causal, key_mask=keep)
    xq, xk, xv, xmask = (backend.asarray(a) for a in (q, k, v, keep))
    gq, gk, gv, gmask, ungroup = grouped(xq, xk, xv, xmask)
    out = ungroup(la.linear_attention(gq, gk, gv, FM, causal=causal, key_mask=gmask))
    assert_close(backend, out, expected, rtol=1e-10, atol=1e-12)


def test_per_query_head_mask_and_state(backend: Backend) -> None:
    """A (B, H, L) mask, and decoding in two pieces with the grouped state."""
    q, k, v, _ = _inputs()
    keep = np.random.default_rng(1).random((B, H, L)) > 0.3
    expected = la.linear_attention(q, _repeated(k), _repeated(v), FM, causal=True, key_mask=keep)
    xq, xk, xv, xmask = (backend.asarray(a) for a in (q, k, v, keep))
    gq, gk, gv, gmask, ungroup = grouped(xq, xk, xv, xmask)
    cut = 10
    first, state = la.linear_attention(
        gq[..., :cut, :],
        gk[..., :cut, :],
        gv[..., :cut, :],
        FM,
        causal=True,
        key_mask=gmask[..., :cut],
        return_state=True,
    )
    second = la.linear_attention(
        gq[..., cut:, :],
        gk[..., cut:, :],
        gv[..., cut:, :],
        FM,
        causal=True,
        key_mask=gmask[..., cut:],
        state=state,
    )
    assert tuple(state.kv.shape[:3]) == (B, H_KV, H // H_KV)
    xp = backend.xp
    assert_close(backend, ungroup(xp.concat([first, second], axis=-2)), expected, rtol=1e-10)


def test_grouping_is_views_of_the_inputs() -> None:
    q, k, v, keep = _inputs()
    gq, gk, gv, gmask, _ = grouped(q, k, v, keep)
    for original, view in ((q, gq), (k, gk), (v, gv), (keep, gmask)):
        assert np.shares_memory(original, view)


def test_grouping_is_views_of_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    q, k, v, keep = (torch.from_numpy(a) for a in _inputs())
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a (B, L, H, d) layout, as in models
    gq, gk, _, _, _ = grouped(q, k, v, keep)
    assert gq.data_ptr() == q.data_ptr() and gk.data_ptr() == k.data_ptr()
    assert gk.stride()[2] == 0 or gk.shape[2] == 1


def test_key_features_are_computed_once_per_key_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys reach the feature map with H_kv heads, never H (no per-query-head copy)."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    original = la.FeatureMap.signed_log_features

    def recording(self, x, /, *, role=None, statistics=None):  # type: ignore[no-untyped-def]
        shapes.append((role, tuple(x.shape)))
        return original(self, x, role=role, statistics=statistics)

    monkeypatch.setattr(la.FeatureMap, "signed_log_features", recording)
    q, k, v, keep = _inputs()
    gq, gk, gv, gmask, _ = grouped(q, k, v, keep)
    la.linear_attention(gq, gk, gv, FM, key_mask=gmask, backend="array_api")
    assert ("key", (B, H_KV, 1, L, D)) in shapes, shapes


@pytest.mark.parametrize("heads_kv", [1, H])
def test_no_grouping_needed_returns_the_inputs(heads_kv: int) -> None:
    q, k, v, keep = _inputs(heads_kv)
    gq, gk, gv, gmask, ungroup = grouped(q, k, v, keep)
    assert (gq, gk, gv, gmask) == (q, k, v, keep)
    assert ungroup(q) is q


def test_heads_that_do_not_divide_are_refused() -> None:
    q, k, v, _ = _inputs(4)
    with pytest.raises(ValueError, match=r"k.shape\[-3\] to divide q.shape\[-3\] = 6; got 4"):
        grouped(q, k, v)


def test_keys_and_values_with_different_heads_are_refused() -> None:
    q, k, _, _ = _inputs()
    with pytest.raises(ValueError, match="k and v must have the same number of heads"):
        grouped(q, k, _repeated(k))


def test_a_mask_with_another_head_count_is_refused() -> None:
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="key_mask's head axis"):
        grouped(q, k, v, np.ones((B, 4, L), dtype=bool))


def test_the_front_door_takes_fewer_key_value_heads() -> None:
    rng = np.random.default_rng(5)
    q = rng.normal(size=(2, 8, 20, 8))
    k, v = (rng.normal(size=(2, 2, 20, 8)) for _ in range(2))
    mask = rng.random((2, 1, 20)) > 0.2
    fm = la.FeatureMap(8, 16, seed=0)
    repeat = lambda x: np.repeat(x, 4, axis=1)  # noqa: E731
    for options in ({"causal": True}, {}, {"causal": True, "window": 4, "sink_keys": 2}):
        grouped_out = la.linear_attention(q, k, v, fm, key_mask=mask, **options)
        repeated = la.linear_attention(q, repeat(k), repeat(v), fm, key_mask=mask, **options)
        np.testing.assert_allclose(grouped_out, repeated, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        la.softmax_attention(q, k, v, key_mask=mask),
        la.softmax_attention(q, repeat(k), repeat(v), key_mask=mask),
        rtol=1e-12,
    )
    with pytest.raises(ValueError, match="must broadcast together"):
        la.linear_attention(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1), fm)
