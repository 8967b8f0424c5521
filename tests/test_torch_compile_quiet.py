"""``torch.compile(fullgraph=True)`` of the front door: one graph, and not one warning.

array-api-compat wraps its type and namespace tests in ``functools.lru_cache``, and
Dynamo traces through such a wrapper with a ``UserWarning`` for each one it meets (about
twenty per compiled call while linattn asked array-api-compat directly).  ``linattn._xp``
answers these questions itself; here every warning is an error.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import linattn as la  # noqa: E402

#: A typical call of each kind: features causal and bidirectional (on the kernels where
#: Numba is installed, and on the array-API path), and the hybrid's window and sinks.
CALLS: dict[str, dict[str, Any]] = {
    "causal": {"causal": True},
    "causal-array-api": {"causal": True, "backend": "array_api"},
    "bidirectional": {},
    "window": {"window": 4, "sink_keys": 1},
    "causal-window": {"causal": True, "window": 4, "sink_keys": 1},
}


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("options", list(CALLS.values()), ids=list(CALLS))
def test_compiles_in_one_graph_without_warnings(options: dict[str, Any]) -> None:
    feature_map = la.FeatureMap(8, 16, kind="hyperbolic", seed=0)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 8, generator=generator) for _ in range(3))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = la.linear_attention(q, k, v, feature_map, **options)
        assert isinstance(out, torch.Tensor)
        return out

    expected = attention(q, k, v)
    # Dynamo warns once per process for each place (torch._dynamo.utils.warn_once):
    # forget what earlier tests compiled so that this compile would warn again.
    torch.compiler.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
        out = compiled(q, k, v)
    torch.testing.assert_close(out, expected)
