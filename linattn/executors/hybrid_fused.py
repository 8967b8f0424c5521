"""The one-pass hybrid executors: the exact parts (window, sinks, exact keys) and the far
keys in one compiled pass each (:mod:`linattn.hybrid.paths`, the kernels of
``linattn_numba.cpu.hybrid`` and ``linattn_numba.cpu.bidirectional``), NumPy arrays.

They differ in what they take and in the pass they run; what they need of the far keys
is one check (:func:`linattn.executors.parts.fused_far_keys_why_not`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from linattn import _dispatch
from linattn._call import Call
from linattn._xp import Array, Namespace
from linattn.executors.base import Executor, Result, Runner, Takes
from linattn.executors.parts import finish, fused_far_keys_why_not, prepare
from linattn.hybrid import paths
from linattn.hybrid.parts import Part

__all__ = [
    "CAUSAL",
    "GLOBAL",
    "TAKES",
    "WINDOW",
    "HybridCausalFused",
    "HybridGlobalFused",
    "HybridWindowFused",
]


#: What every one-pass hybrid executor takes; each narrows it.
TAKES = Takes(
    libraries=("numpy",),
    exact_parts=True,
    maps=("random", "fitted"),
    backends=("auto", "numba"),
)


class _OnePass(Executor):
    """An executor of the one-pass hybrid kernels: :meth:`one_pass` over the call's parts."""

    compiled = True

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        return fused_far_keys_why_not(call, scan)

    def one_pass(self, xp: Namespace, parts: list[Part]) -> tuple[Array, dict[str, Any]]:
        """The output and the far keys' state after the call (``{}``: none)."""
        raise NotImplementedError

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        checked = prepare(call, scan)
        out, far_state = self.one_pass(checked.info.xp, checked.parts)
        return finish(call, checked, out, far_state)


class HybridCausalFused(_OnePass):
    name = "hybrid-causal-fused"
    summary = "causal window, sinks and fused far keys in one compiled pass"
    takes = replace(TAKES, causal=True)

    def one_pass(self, xp: Namespace, parts: list[Part]) -> tuple[Array, dict[str, Any]]:
        return paths.fused_causal_parts(xp, parts)


class HybridWindowFused(_OnePass):
    name = "hybrid-window-fused"
    summary = "bidirectional window, sinks and both fused far passes in one compiled pass"
    takes = replace(TAKES, causal=False, window=True)

    def one_pass(self, xp: Namespace, parts: list[Part]) -> tuple[Array, dict[str, Any]]:
        return paths.fused_bidirectional_parts(xp, parts), {}


class HybridGlobalFused(_OnePass):
    name = "hybrid-global-fused"
    summary = "bidirectional exact keys without a window, far keys in the fused global pass"
    # (the fused bidirectional pass computes random features only)
    takes = replace(TAKES, causal=False, window=False, maps=("random",))

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        if call.sink_keys == 0 and call.exact_key_mask is None:
            return ["no exact keys"]
        assert call.feature_map is not None  # (declared)
        if call.feature_map.needs_calibration:
            return ["the map needs this call's statistics"]
        return super().more_reasons(call, scan)

    def one_pass(self, xp: Namespace, parts: list[Part]) -> tuple[Array, dict[str, Any]]:
        return paths.fused_global_parts(xp, parts), {}


CAUSAL = HybridCausalFused()
WINDOW = HybridWindowFused()
GLOBAL = HybridGlobalFused()
