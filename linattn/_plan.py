"""The one place that decides who runs a call of :func:`linattn.linear_attention`.

:func:`plan_call` asks each executor of :data:`EXECUTORS` in turn whether it serves a
normalised :class:`linattn._call.Call`; the first that does runs it, and every one
before it says why it did not (as xformers' dispatcher does).  The requirements are
written here and nowhere else: the executors (``linattn.executors``) only run what they
are given, and ``linattn_numba`` is reached through :mod:`linattn._dispatch`, whose
:func:`~linattn._dispatch.causal_plan` picks the path of the causal scan inside them
(compiled kernel, JAX scan, Dask graph, array API).

Adding an executor is one module in ``linattn/executors/`` (a ``run(call, plan,
attend)``) and one line in :data:`EXECUTORS` with its requirement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from linattn import _decode, _dispatch
from linattn._call import Call, normalise_call
from linattn._xp import dtype_name, is_array, is_dask_array, is_jax_array
from linattn.executors import (
    dask_scan,
    decode,
    dense_hybrid,
    fused_bidirectional,
    fused_causal,
    hybrid_causal_fused,
    hybrid_global_fused,
    hybrid_parts,
    hybrid_window_fused,
    portable,
    sub_calls,
    torch_kernels,
)
from linattn.features import FeatureMap
from linattn.hybrid import dense
from linattn.state import LinearAttentionState

__all__ = ["AttentionPlan", "Executor", "execute", "plan_attention", "plan_call", "run_call"]

#: What an executor returns: the output (caller's dtype) and the new state, or ``None``.
Result = tuple[Any, LinearAttentionState | None]
#: An executor: ``run(call, plan, attend)``; ``attend`` runs a sub-call (Dask chunks).
Executor = Callable[[Call, "AttentionPlan", Callable[[Call], Result]], Result]


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
        Each executor asked before it, with the reason it does not serve the call.
    scan : Plan
        The path of the causal scan inside the executor (:func:`linattn.causal_plan`):
        compiled kernel, JAX scan or array API.

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


def _asked_backend(call: Call) -> str:
    return _dispatch.resolve_backend(call.backend)


def _numpy(*arrays: Any) -> bool:
    return all(type(x) is np.ndarray for x in arrays)


def _numpy_or_none(x: Any) -> bool:
    return x is None or type(x) is np.ndarray


# -- the requirements: None where the executor serves the call, else why not -------------


def _decode_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """A few new NumPy tokens after a plain causal state, in one kernel call."""
    q, k, v, state, fm = call.q, call.k, call.v, call.state, call.feature_map
    if call.exact_parts or not call.causal or not isinstance(state, LinearAttentionState):
        return "not a causal call with a plain state (no window or sinks)"
    if _asked_backend(call) == "array_api":
        return "backend='array_api'"
    if state.sink_keys or not isinstance(fm, FeatureMap):
        return "a state with sink keys, or no feature map"
    return_state: object = call.return_state  # (as given: typed bool, not checked yet)
    if not (return_state is True or return_state is False):
        return "return_state is not a bool"
    if not (_numpy(q, k, v, state.kv, state.log_shift) and _numpy_or_none(call.key_mask)):
        return "not NumPy arrays"
    reason = _decode.why_not(q, k, v, fm, call.key_mask, state, call.chunk_size)
    if reason is None and _dispatch.decode_kernel() is None:
        reason = "the decoding kernel cannot be imported; install linattn[numba]"
    return reason


def _dask_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Dask arrays: a graph over their sequence chunks."""
    if not is_dask_array(call.q):
        return "not Dask arrays"
    return "exact parts run portably on Dask arrays" if call.exact_parts else None


def _exact_parts_why_not(call: Call) -> str | None:
    return None if call.exact_parts else "no window, sink keys or exact keys"


def _dense_hybrid_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """A short self-attention hybrid with a fitted map as matrix products: torch CPU
    tensors (torch's fused attention kernel for the near keys; autograd differentiates
    it) or JAX arrays on the CPU (eager or traced; JAX differentiates it)."""
    if (why := _exact_parts_why_not(call)) is not None:
        return why
    if _asked_backend(call) != "auto":
        return f"backend={_asked_backend(call)!r}"
    fm = call.feature_map
    if fm is None or fm.parameters is None:
        return "no fitted map (random features keep their scans' per-feature stabilisation)"
    if call.state is not None or call.return_state is not False:
        return "a state is asked for or continued"
    arrays = {"q": call.q, "k": call.k, "v": call.v}
    if all(is_jax_array(x) for x in arrays.values()):
        import jax

        if jax.default_backend() != "cpu":
            return f"JAX's default backend is {jax.default_backend()!r} (measured on the CPU)"
        kind = "jax"
    else:
        for x in arrays.values():
            if _dispatch.library_of(x) != "torch" or x.device.type != "cpu":
                return "not torch CPU tensors or JAX arrays"
            if not all(isinstance(n, int) for n in x.shape):
                return "symbolic shapes (torch.compile with dynamic shapes)"
        import torch

        grad = torch.is_grad_enabled() and any(x.requires_grad for x in arrays.values())
        kind = "torch-grad" if grad else "torch"
    for name, x in arrays.items():
        dtype = dtype_name(x.dtype).removeprefix("torch.")
        if dtype not in ("float32", "float64"):
            return f"{name} is {dtype}"
    length, limit = call.q.shape[-2], dense.max_length(bool(call.causal), kind)
    if call.k.shape[-2] != length or length > limit:
        what = ("causal " if call.causal else "") + "self-attention"
        grad_note = " with a gradient" if kind == "torch-grad" else ""
        return f"not {what} of at most {limit} tokens{grad_note}"
    return None


def _torch_kernels_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Torch CPU tensors with exact parts, through the compiled kernels the same call on
    NumPy arrays gets (custom operators, forward and backward)."""
    if (why := _exact_parts_why_not(call)) is not None:
        return why
    if _asked_backend(call) == "array_api":
        return "backend='array_api'"
    if call.state is not None or call.return_state is not False:
        return "a state is asked for or continued (decoding runs on the tensors)"
    if not isinstance(call.sink_keys, int):
        return "sink_keys is not an int"
    # Read from types, devices, shapes and dtypes only: no array is made (the plan runs
    # inside torch.compile's tracing, which would trace NumPy calls too).
    arrays = {"q": call.q, "k": call.k, "v": call.v}
    masks = {"key_mask": call.key_mask, "exact_key_mask": call.exact_key_mask}
    for name, x in {**arrays, **masks}.items():
        if x is None:
            continue
        if _dispatch.library_of(x) != "torch" or x.device.type != "cpu":
            return "not torch CPU tensors"
        if not all(isinstance(n, int) for n in x.shape):
            return "symbolic shapes (torch.compile with dynamic shapes)"
        dtype = str(x.dtype).removeprefix("torch.")
        expected = ("float32", "float64") if name in arrays else ("bool",)
        if dtype not in expected:
            return f"{name} is {dtype} (the kernels take {' or '.join(expected)})"
    return _dispatch.numpy_kernels_why_not()


def _hybrid_causal_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Causal window, sinks and fused far keys in one compiled pass."""
    if (why := _exact_parts_why_not(call)) is not None:
        return why
    if not call.causal:
        return "bidirectional"
    return _fused_far_keys_why_not(call, scan)


def _hybrid_window_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Bidirectional window, sinks and both far passes in one compiled pass."""
    if (why := _exact_parts_why_not(call)) is not None:
        return why
    if call.causal:
        return "causal"
    if call.window is None:
        return "no window"
    return _fused_far_keys_why_not(call, scan)


def _hybrid_global_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Bidirectional exact keys without a window, far keys in the fused global pass."""
    if (why := _exact_parts_why_not(call)) is not None:
        return why
    if call.causal or call.window is not None:
        return "causal or a window"
    if call.sink_keys == 0 and call.exact_key_mask is None:
        return "no exact keys"
    if call.feature_map is not None and call.feature_map.needs_calibration:
        return "the map needs this call's statistics"
    return _fused_far_keys_why_not(call, scan, fitted=False)


def _fused_far_keys_why_not(
    call: Call, scan: _dispatch.Plan, *, fitted: bool = True
) -> str | None:
    """The far keys in the one-pass hybrid kernels: NumPy, a map they compute or (the
    window kernels, ``fitted``) a fitted map, whose log-features they are given."""
    if call.feature_map is None:
        return "no feature map (exact sparse attention merges its parts)"
    if fitted and call.feature_map.parameters is not None:
        if _asked_backend(call) == "array_api":  # (no scan to say so: its features are given)
            return "backend='array_api'"
        return _dispatch.hybrid_kernel_why_not(call.q)
    if not scan.fused:
        return f"no fused pass: {scan.reason}"
    return _dispatch.hybrid_kernel_why_not(call.q)


def _hybrid_parts_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Exact parts and far keys as partial rows, merged as in online softmax."""
    return _exact_parts_why_not(call)


def _fused_causal_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Causal features and attention in one compiled pass, no L x m array."""
    if not call.causal:
        return "bidirectional"
    if call.feature_map is not None and call.feature_map.parameters is not None:
        return _fitted_fused_why_not(call, scan)
    return None if scan.fused else f"no fused pass: {scan.reason}"


def _fused_bidirectional_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """Bidirectional features, state and readout in the fused compiled pass."""
    if call.causal:
        return "causal"
    if call.feature_map is not None and call.feature_map.parameters is not None:
        return _fitted_fused_why_not(call, scan)
    return _dispatch.bidirectional_why_not(call.q, call.feature_map, backend=call.backend)


def _fitted_fused_why_not(call: Call, scan: _dispatch.Plan) -> str | None:
    """A fitted map in the fused forward passes, which compute its features per block:
    NumPy arrays only (torch tensors differentiate through the fused backward passes,
    which compute random features only)."""
    if _dispatch.library_of(call.q) != "numpy":
        return "a fitted map: the fused passes compute its features for NumPy arrays only"
    return None if scan.kernel is not None else f"no compiled kernel: {scan.reason}"


def _always(call: Call, scan: _dispatch.Plan) -> str | None:
    """Features in the array API, then the causal scan on its path or one pass."""
    return None


#: Every executor, asked in this order: (name, requirement, what it is, run).
EXECUTORS: tuple[tuple[str, Callable[[Call, _dispatch.Plan], str | None], Executor], ...] = (
    ("decode", _decode_why_not, decode.run),
    ("dask-scan", _dask_why_not, dask_scan.run),
    ("dense-hybrid", _dense_hybrid_why_not, dense_hybrid.run),
    ("torch-kernels", _torch_kernels_why_not, torch_kernels.run),
    ("hybrid-causal-fused", _hybrid_causal_why_not, hybrid_causal_fused.run),
    ("hybrid-window-fused", _hybrid_window_why_not, hybrid_window_fused.run),
    ("hybrid-global-fused", _hybrid_global_why_not, hybrid_global_fused.run),
    ("hybrid-parts", _hybrid_parts_why_not, hybrid_parts.run),
    ("fused-causal", _fused_causal_why_not, fused_causal.run),
    ("fused-bidirectional", _fused_bidirectional_why_not, fused_bidirectional.run),
    ("portable", _always, portable.run),
)
_RUN = {name: run for name, _, run in EXECUTORS}
#: Why each executor serves a call it takes: its requirement's first docstring line.
_REASONS = {
    name: (doc := (why_not.__doc__ or "").strip().split("\n")[0].rstrip("."))[:1].lower() + doc[1:]
    for name, why_not, _ in EXECUTORS
}


def _scan_plan(call: Call) -> _dispatch.Plan:
    """The causal scan's path; exact parts on Dask arrays run the portable parts."""
    try:
        scan = _dispatch.scan_plan(call.q, call.feature_map, backend=call.backend)
    except ValueError as error:  # backend="numba" that no kernel serves
        reasons = [f"{name}: needs a compiled kernel" for name, _, _ in EXECUTORS]
        raise ValueError(f"{error}; no executor serves this call: " + "; ".join(reasons)) from None
    if call.exact_parts and scan.path == "dask-scan":
        scan = _dispatch.scan_plan(call.q, call.feature_map, backend="array_api")
    return scan


#: The plan of a decoding step: its kernel runs the causal scan, features included.
_DECODE_SCAN = _dispatch.Plan("numba-cpu", "the decoding kernel", fused=True)


def plan_call(call: Call) -> AttentionPlan:
    """The executor that runs ``call``, with its reason and every earlier one's."""
    rejected: list[tuple[str, str]] = []
    scan = _DECODE_SCAN
    for name, why_not, _ in EXECUTORS:
        if name != "decode" and scan is _DECODE_SCAN:  # (a decoding step never needs it)
            scan = _scan_plan(call)
        reason = why_not(call, scan)
        if reason is None:
            return AttentionPlan(name, _REASONS[name], tuple(rejected), scan)
        rejected.append((name, reason))
    raise AssertionError("the portable executor serves every call")  # pragma: no cover


def execute(call: Call) -> Any:
    """Run ``call`` on its executor; the front door's result (output, or with the state)."""
    plan = plan_call(call)
    out, state = _RUN[plan.executor](call, plan, run_call)
    if call.ungroup is not None:
        out = call.ungroup(out)
    return (out, state) if call.return_state else out


def run_call(call: Call) -> Result:
    """A sub-call's output and state (a Dask chunk's attention), through the plan."""
    plan = plan_call(call)
    return _RUN[plan.executor](call, plan, run_call)


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
    return plan_call(call)
