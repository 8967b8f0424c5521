"""The one place that decides who runs a call of :func:`linattn.linear_attention`.

:func:`plan_call` asks each executor of :data:`EXECUTORS` in turn whether it serves a
normalised :class:`linattn._call.Call`; the first that does runs it, and every one
before it says why it did not (as xformers' dispatcher does).  What each executor takes
is declared by the executor itself (:class:`linattn.executors.base.Takes`, and its
``why_not``); this module holds only the order and the formatting, and
``linattn_numba`` is reached through :mod:`linattn._dispatch`, whose
:func:`~linattn._dispatch.scan_plan` picks the path of the causal scan inside them
(compiled kernel, JAX scan, Dask graph, array API) and carries the call's backend to
every compiled part.

Adding an executor is one module in ``linattn/executors/`` (a subclass of
:class:`linattn.executors.base.Executor`, with its backward where it has one) and one
line in :data:`EXECUTORS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from linattn import _dispatch, _warm
from linattn._call import Call, check_call, normalise_call
from linattn._xp import is_array
from linattn.executors import (
    dask_scan,
    decode,
    dense_hybrid,
    fused_bidirectional,
    fused_causal,
    hybrid_fused,
    hybrid_parts,
    portable,
    sub_calls,
    torch_kernels,
)
from linattn.executors.base import Backward, Executor, Facts, Result
from linattn.features import FeatureMap

__all__ = [
    "EXECUTORS",
    "AttentionPlan",
    "backward_of",
    "chosen",
    "execute",
    "executor_named",
    "plan_attention",
    "plan_call",
    "run_call",
    "start_compiling",
]


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Who runs one call, why, and why every executor asked before it did not.

    Attributes
    ----------
    executor : str
        The name of the executor that runs the call (one of ``linattn._plan.EXECUTORS``).
    reason : str
        Why it serves the call.
    rejected : tuple of (str, str)
        Each executor asked before it, with the reasons it does not serve the call
        (joined by ``"; "``).
    scan : Plan
        The path of the causal scan inside the executor
        (:func:`linattn._dispatch.scan_plan`): compiled kernel, JAX scan or array API.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x = np.zeros((2, 8, 16))
    >>> plan = la.plan_attention(x, x, x, la.FeatureMap(16, 32), backend="array_api")
    >>> plan.executor
    'portable'
    >>> dict(plan.rejected)["fused-bidirectional"]
    "backend='array_api'"
    """

    executor: str
    reason: str
    rejected: tuple[tuple[str, str], ...]
    scan: _dispatch.Plan

    def __str__(self) -> str:
        lines = [f"{self.executor}: {self.reason}"]
        lines += [f"  not {name}: {why}" for name, why in self.rejected]
        lines.append(f"  causal scan: {self.scan.path} ({self.scan.reason})")
        return "\n".join(lines)


#: Every executor, asked in this order: the first that serves a call runs it.
EXECUTORS: tuple[Executor, ...] = (
    decode.EXECUTOR,
    dask_scan.EXECUTOR,
    dense_hybrid.EXECUTOR,
    torch_kernels.EXECUTOR,
    hybrid_fused.CAUSAL,
    hybrid_fused.WINDOW,
    hybrid_fused.GLOBAL,
    hybrid_parts.EXECUTOR,
    fused_causal.EXECUTOR,
    fused_bidirectional.EXECUTOR,
    portable.EXECUTOR,
)
_BY_NAME = {executor.name: executor for executor in EXECUTORS}
#: The executors that read no causal scan (asked before it is planned).
_NO_SCAN = (decode.EXECUTOR,)


def executor_named(name: str) -> Executor:
    """The executor of that name (:attr:`AttentionPlan.executor`)."""
    return _BY_NAME[name]


def _scan_plan(call: Call) -> _dispatch.Plan:
    """The causal scan's path; exact parts on Dask arrays run the portable parts."""
    try:
        scan = _dispatch.scan_plan(call.q, call.feature_map, backend=call.backend)
    except ValueError as error:  # backend="numba" that no kernel serves
        reasons = [f"{executor.name}: needs a compiled kernel" for executor in EXECUTORS]
        raise ValueError(f"{error}; no executor serves this call: " + "; ".join(reasons)) from None
    if call.exact_parts and scan.path == "dask-scan":
        scan = _dispatch.scan_plan(call.q, call.feature_map, backend="array_api")
    return scan


#: The plan of a decoding step: its kernel runs the causal scan, features included.
_DECODE_SCAN = _dispatch.Plan("numba-cpu", "the decoding kernel", fused=True)


def plan_call(call: Call) -> AttentionPlan:
    """The executor that runs ``call``, with its reason and every earlier one's reasons."""
    rejected: list[tuple[str, str]] = []
    executor, scan, _ = _choose(call, rejected, start=False)
    return AttentionPlan(executor.name, executor.summary, tuple(rejected), scan)


def _choose(
    call: Call, rejected: list[tuple[str, str]] | None = None, *, start: bool = True
) -> tuple[Executor, _dispatch.Plan, Call]:
    """The first executor that serves ``call``, the scan plan and the call it runs (the
    call itself, or the call on the array API while its kernels compile in the
    background: :mod:`linattn._warm`); each executor asked before it goes to
    ``rejected`` with its reasons.  ``start=False``: a plan only explained, which starts
    no background compile."""
    executor, scan = _first(call, rejected)
    if not executor.uses_kernels(call, scan):
        return executor, scan, call
    cold = _warm.cold(executor.name, call, start=start)
    if cold is None:
        return executor, scan, call
    portable_call = call._replace(backend="array_api")
    asked: list[tuple[str, str]] | None = None if rejected is None else []
    executor, scan = _first(portable_call, asked)
    if rejected is not None and asked is not None:
        # Those asked before the executor that waits keep their reasons; it and those
        # after it wait for the kernels.
        before = dict(rejected)
        rejected[:] = [
            (name, before[name] if name in before else why.replace("backend='array_api'", cold))
            for name, why in asked
        ]
    return executor, dataclasses.replace(scan, reason=cold), portable_call


def _first(
    call: Call, rejected: list[tuple[str, str]] | None = None
) -> tuple[Executor, _dispatch.Plan]:
    """The first executor that serves ``call``, and the scan plan.  Without ``rejected``
    (a call about to run, whose plan no one reads) the executors whose declarations the
    call falls outside are passed over without their words: the choice is the same."""
    scan = _DECODE_SCAN
    facts = Facts.of(call)
    for executor in EXECUTORS:
        if executor not in _NO_SCAN and scan is _DECODE_SCAN:
            scan = _scan_plan(call)
        if rejected is None and not executor.takes.admits(facts):
            continue
        reasons = executor.why_not(call, scan, facts)
        if not reasons:
            return executor, scan
        if rejected is not None:
            rejected.append((executor.name, "; ".join(reasons)))
    raise AssertionError("the portable executor serves every call")  # pragma: no cover


def chosen(call: Call) -> tuple[Executor, _dispatch.Plan]:
    """The executor that runs ``call`` and the scan plan, without the words of a plan
    (:func:`plan_call` explains): what runs a call, and what its VJP asks."""
    executor, scan, _ = _choose(call)
    return executor, scan


def start_compiling(call: Call) -> bool:
    """Start the background compile of the kernels ``call`` would run (where
    :mod:`linattn._warm` applies and they are not ready); whether they are compiling.
    (``linattn demo`` starts its timed calls' kernels before its accuracy study.)"""
    executor, scan = _first(call)
    return executor.uses_kernels(call, scan) and _warm.cold(executor.name, call) is not None


def backward_of(executor: Executor, call: Call) -> Backward | None:
    """``executor``'s own backward for ``call``, or ``None`` where it has none (the
    portable adjoint runs): :func:`linattn.linear_attention_vjp` asks here."""
    return executor.backward(call)


def execute(call: Call) -> Any:
    """Run ``call`` on its executor; the front door's result (output, or with the state)."""
    out, state = run_call(call)
    if call.ungroup is not None:
        out = call.ungroup(out)
    return (out, state) if call.return_state else out


def run_call(call: Call) -> Result:
    """A call's output and state through the plan (also a Dask chunk's, a torch
    operator's NumPy call)."""
    executor, scan, runs = _choose(call)
    if runs is not call:  # (its kernels compile in the background, on another core)
        with _dispatch.single_threaded_blas():
            return executor.run(runs, scan, run_call)
    return executor.run(call, scan, run_call)


sub_calls.set_runner(run_call)  # (for the torch operators, which run outside a call)


def plan_attention(
    q: Any, k: Any, v: Any, /, feature_map: FeatureMap | None, **options: Any
) -> AttentionPlan:
    """The plan :func:`linattn.linear_attention` would follow for these arguments.

    Takes exactly :func:`linattn.linear_attention`'s arguments and checks them as it
    does; returns which executor runs the call, why, and why each executor asked
    before it does not.  Nothing is computed.

    Parameters
    ----------
    q, k, v : arrays
    feature_map : FeatureMap or None
    **options
        The keyword arguments of :func:`linattn.linear_attention`.

    Returns
    -------
    AttentionPlan

    Raises
    ------
    ValueError
        Where no executor can serve the call (e.g. ``backend="numba"`` on arrays no
        compiled kernel takes): the message lists every executor's reason.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x = np.zeros((2, 64, 16), dtype=np.float32)
    >>> fm = la.FeatureMap(16, 32, seed=0)
    >>> plan = la.plan_attention(x, x, x, fm, causal=True, window=8, backend="array_api")
    >>> plan.executor, plan.scan.path
    ('hybrid-parts', 'array-api')
    """
    call = normalise_call(q, k, v, feature_map, **options)
    if not is_array(call.q):
        raise TypeError(f"q must be an array; got {type(call.q).__name__}")
    check_call(call)
    return plan_call(call)
