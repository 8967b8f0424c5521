"""Hypothesis: valid inputs agree with the reference; invalid ones raise the documented error."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import linear_reference

import linattn as la

KINDS = ["positive", "hyperbolic", "elu", "random_relu"]


@st.composite
def valid_cases(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    causal = draw(st.booleans())
    lq = draw(st.integers(1, 12))
    lk = lq if causal else draw(st.integers(1, 12))
    d = draw(st.integers(1, 6))
    dv = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(KINDS))
    m = d if kind == "elu" else 2 * draw(st.integers(1, 8))
    return {
        "batch": batch,
        "causal": causal,
        "lq": lq,
        "lk": lk,
        "d": d,
        "dv": dv,
        "kind": kind,
        "m": m,
        "dtype": draw(st.sampled_from(["float32", "float64"])),
        "masked": draw(st.booleans()),
        "split": draw(st.integers(1, lq - 1))
        if causal and lq > 1 and draw(st.booleans())
        else None,
        "chunk_size": draw(st.integers(1, 8)),
        "seed": draw(st.integers(0, 2**16)),
        # Broadcast a leading axis of k/v against q's?
        "broadcast_kv": draw(st.booleans()),
    }


def _arrays(case):
    rng = np.random.default_rng(case["seed"])
    b = case["batch"]
    kv_batch = tuple(1 for _ in b) if case["broadcast_kv"] else b
    q = 0.7 * rng.normal(size=(*b, case["lq"], case["d"]))
    k = 0.7 * rng.normal(size=(*kv_batch, case["lk"], case["d"]))
    v = rng.normal(size=(*kv_batch, case["lk"], case["dv"]))
    mask = rng.random(size=(case["lk"],)) > 0.3 if case["masked"] else None
    fm = la.FeatureMap(case["d"], case["m"], kind=case["kind"], seed=case["seed"])
    return q, k, v, mask, fm


@settings(max_examples=80, deadline=None)
@given(valid_cases())
def test_valid_inputs_agree_with_reference(case) -> None:
    q, k, v, mask, fm = _arrays(case)
    dt = case["dtype"]
    args = {"causal": case["causal"], "chunk_size": case["chunk_size"]}
    if case["split"] is None:
        out = la.linear_attention(
            q.astype(dt), k.astype(dt), v.astype(dt), fm, key_mask=mask, **args
        )
    else:
        s = case["split"]
        first, state = la.linear_attention(
            *(a[..., :s, :].astype(dt) for a in (q, k, v)),
            fm,
            key_mask=None if mask is None else mask[:s],
            return_state=True,
            **args,
        )
        second = la.linear_attention(
            *(a[..., s:, :].astype(dt) for a in (q, k, v)),
            fm,
            key_mask=None if mask is None else mask[s:],
            state=state,
            **args,
        )
        out = np.concatenate(
            [np.broadcast_to(first, (*second.shape[:-2], *first.shape[-2:])), second], axis=-2
        )
    assert out.dtype == np.dtype(dt)
    expected = linear_reference(
        q.astype(dt), k.astype(dt), v.astype(dt), fm, causal=case["causal"], key_mask=mask
    )
    rtol, atol = (1e-9, 1e-11) if dt == "float64" else (1e-4, 1e-5)
    np.testing.assert_allclose(out, np.broadcast_to(expected, out.shape), rtol=rtol, atol=atol)


CORRUPTIONS = [
    "head_dim",
    "int_dtype",
    "complex_dtype",
    "kv_length",
    "causal_lengths",
    "chunk_size",
    "mask_length",
    "mask_dtype",
    "batch",
    "foreign_state",
    "feature_map",
    "too_few_dims",
    "mixed_libraries",
]


@settings(max_examples=80, deadline=None)
@given(valid_cases(), st.sampled_from(CORRUPTIONS), st.integers(-3, 0))
def test_invalid_inputs_raise_documented_errors(case, corruption, bad_int) -> None:
    q, k, v, mask, fm = _arrays(case)
    kwargs: dict = {"causal": case["causal"], "key_mask": mask, "chunk_size": case["chunk_size"]}
    if corruption == "head_dim":
        q = np.concatenate([q, q[..., :1]], axis=-1)
    elif corruption == "int_dtype":
        k = k.astype(np.int32)
    elif corruption == "complex_dtype":
        v = v.astype(np.complex64)
    elif corruption == "kv_length":
        v = np.concatenate([v, v[..., :1, :]], axis=-2)
    elif corruption == "causal_lengths":
        kwargs["causal"] = True
        q = np.concatenate([k, k[..., :1, :]], axis=-2)  # one query more than keys
    elif corruption == "chunk_size":
        kwargs["chunk_size"] = bad_int
    elif corruption == "mask_length":
        kwargs["key_mask"] = np.ones(case["lk"] + 1, dtype=bool)
    elif corruption == "mask_dtype":
        kwargs["key_mask"] = np.ones(case["lk"], dtype=np.float32)
    elif corruption == "batch":
        q = np.broadcast_to(q, (2, *q.shape))
        k = np.broadcast_to(k, (3, *k.shape))
    elif corruption == "foreign_state":
        kwargs["causal"] = True
        q = k
        other = la.FeatureMap(case["d"], case["m"], kind="positive", seed=case["seed"] + 1)
        _, state = la.linear_attention(k, k, v, other, causal=True, return_state=True)
        kwargs["state"] = state
    elif corruption == "feature_map":
        fm = la.FeatureMap(case["d"] + 1, 4)
    elif corruption == "too_few_dims":
        q = q.reshape(-1)
    elif corruption == "mixed_libraries":
        import array_api_strict

        k = array_api_strict.asarray(k)
    try:
        la.linear_attention(q, k, v, fm, **kwargs)
    except (ValueError, TypeError) as error:
        message = str(error)
        assert "got" in message, message
    else:
        raise AssertionError(f"{corruption} was accepted")
