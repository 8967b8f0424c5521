"""The float32 Numba kernels compute in float32: no float64 arithmetic in their machine code.

A Python literal inside ``@njit`` code is float64 (``-np.inf``, ``1``, an integer sign),
and float32 arithmetic with it is float64: a float32 kernel then runs its loops at half
the vector width, or converts every element (measured: the stabilisers' row maxima ran
27 instead of 9.6 us per block of 2 x 64 x 256, and the causal pass 20 % slower).  Each
kernel is compiled here for float32 through its entry point (forward and backward), then
every float32 specialisation of every kernel function is read for double-precision
``fadd``/``fsub``/``fmul``/``fdiv`` instructions in its LLVM IR.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import linattn as la

numba = pytest.importorskip("numba")
from linattn_numba import _machinery  # noqa: E402
from linattn_numba.cpu import scalars  # noqa: E402

KERNEL_MODULES = ("scalars", "features", "chunks", "exact", "causal", "fused_causal",
                  "fused_causal_backward", "bidirectional", "decode", "hybrid",
                  "window")  # fmt: skip
MODULES = tuple(importlib.import_module(f"linattn_numba.cpu.{name}") for name in KERNEL_MODULES)
DOUBLE_ARITHMETIC = re.compile(r"= f(add|sub|mul|div)( [a-z]+)* double ")


def _float32_calls() -> None:
    """Forward and backward of every CPU kernel on small float32 inputs."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.normal(size=(1, 2, 80, 8)).astype(np.float32) for _ in range(4))
    mask = rng.random((1, 2, 80)) > 0.2
    for kind in ("positive", "hyperbolic"):
        fm = la.FeatureMap(8, 16, kind=kind, seed=0)
        for causal in (True, False):
            la.linear_attention(q, k, v, fm, causal=causal, key_mask=mask)
            la.linear_attention_vjp(q, k, v, fm, g, causal=causal, key_mask=mask)
            for window in (None, 4, 20):  # sinks alone, direct loops, blocked windows
                la.linear_attention(q, k, v, fm, causal=causal, window=window, sink_keys=2)
    la.linear_attention(q, k, v, None, causal=True, window=4)
    la.linear_attention_vjp(q, k, v, None, g, causal=True, window=4)
    fitted = la.FeatureMap.fitted(rng.normal(size=(2, 8, 4)).astype(np.float32) * 1e3, tied=True,
                                  far_weight=np.float32(0.5))  # fmt: skip
    for causal in (True, False):  # (the fitted features' floor, the rows' rescue)
        la.linear_attention(q, k, v, fitted, causal=causal, window=4, sink_keys=2)
    fm = la.FeatureMap(8, 16, seed=0)
    _, state = la.linear_attention(q, k, v, fm, causal=True, return_state=True)
    la.linear_attention(q[..., :1, :], k[..., :1, :], v[..., :1, :], fm, causal=True,
                        state=state, return_state=True)  # fmt: skip


def _dispatchers() -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()
    for module in MODULES:
        for name, obj in sorted(vars(module).items()):
            candidates = [obj]
            if isinstance(obj, _machinery.Variants):
                candidates = list(obj.dispatchers.values())
            for dispatcher in candidates:
                if isinstance(dispatcher, numba.core.registry.CPUDispatcher) and (
                    id(dispatcher) not in seen
                ):
                    seen.add(id(dispatcher))
                    yield f"{module.__name__}.{name}", dispatcher


def _llvm(dispatcher: Any, signature: tuple[Any, ...]) -> str:
    """The LLVM IR of one specialisation.  One loaded from the on-disk compile cache
    (``LINATTN_NUMBA_CACHE=1``, as under nox) keeps no IR: it is compiled again here, with
    the same options, without the cache."""
    if signature not in dispatcher.stats.cache_hits:
        return str(dispatcher.inspect_llvm(signature))
    options = {k: v for k, v in dispatcher.targetoptions.items() if k != "nopython"}
    fresh = numba.njit(**options)(dispatcher.py_func)
    fresh.compile(signature)
    return str(fresh.inspect_llvm(signature))


def test_float32_kernels_do_no_float64_arithmetic() -> None:
    _float32_calls()
    irs: dict[tuple[str, str], str] = {}
    while True:  # (one loaded from the cache compiled no callee: compiling it again does)
        new = [
            (name, dispatcher, signature)
            for name, dispatcher in _dispatchers()
            for signature in dispatcher.signatures
            if "float64" not in str(signature)
            and "float32" in str(signature)
            and (name, str(signature)) not in irs
        ]
        if not new:
            break
        for name, dispatcher, signature in new:
            irs[name, str(signature)] = _llvm(dispatcher, signature)
    offenders = [
        f"{name}{signature}: {count} double-precision operations"
        for (name, signature), ir in irs.items()
        if (count := len(DOUBLE_ARITHMETIC.findall(ir)))
    ]
    assert len(irs) >= 40, f"only {len(irs)} float32 specialisations were compiled"
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_float64_arithmetic() -> None:
    """The pattern finds what it is for: a float32 kernel with one float64 literal."""

    @numba.njit
    def mixed(x):  # (x * 0.5 is float64 arithmetic: 0.5 is a float64 literal)
        total = x[0] - x[0]
        for i in range(x.shape[0]):
            total += x[i] * 0.5
        return total

    @numba.njit
    def typed(x):
        total = x[0] - x[0]
        for i in range(x.shape[0]):
            total += x[i] * scalars.typed(0.5, total)
        return total

    x = np.ones(4, np.float32)
    assert mixed(x) == typed(x) == 2.0
    assert DOUBLE_ARITHMETIC.findall(mixed.inspect_llvm(mixed.signatures[0]))
    assert not DOUBLE_ARITHMETIC.findall(typed.inspect_llvm(typed.signatures[0]))
