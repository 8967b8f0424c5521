"""What every executor is: what it takes, declared as data; why it does not serve a call;
how it runs one; and, where it has one, its backward.

An executor is one object (as xformers' attention operators are): its :class:`Takes`
says which calls it can serve (array libraries, causal or bidirectional, exact parts,
states, feature maps, dtypes, the backends it serves); :meth:`Executor.why_not` turns
those declarations into reasons, **the call's backend included**, then adds the
executor's own (:meth:`Executor.more_reasons`: a compiled kernel that must import, a
length limit).  :mod:`linattn._plan` holds only the order in which they are asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np

from linattn import _dispatch
from linattn._call import Call
from linattn._xp import Array, dtype_name, is_dask_array, is_jax_array
from linattn.features import FeatureMap
from linattn.state import LinearAttentionState

__all__ = [
    "LIBRARIES",
    "Backward",
    "Executor",
    "Facts",
    "Library",
    "MapKind",
    "Result",
    "Runner",
    "Takes",
    "library",
    "map_kind",
]

#: What an executor returns: the output (caller's dtype) and the new state, or ``None``.
Result = tuple[Any, LinearAttentionState | None]
#: Runs a sub-call through the plan (a Dask chunk's attention, the torch operators' NumPy
#: call): :func:`linattn._plan.run_call`.
Runner = Callable[[Call], Result]
#: An executor's backward: ``(q, k, v, feature_map, key_mask, grad_output, chunk_size=)``
#: in the compute dtype, masked keys zeroed, no incoming state -> ``(dq, dk, dv)`` over
#: the broadcast batch shape (:func:`linattn.linear_attention_vjp` sums them back).
Backward = Callable[..., tuple[Array, Array, Array]]

#: The array libraries (and devices) an executor can declare.
Library = Literal["numpy", "torch-cpu", "jax-cpu", "dask"]
#: How each reads in a reason: ``"not NumPy arrays or torch CPU tensors"``.
LIBRARIES: dict[Library, str] = {
    "numpy": "NumPy arrays",
    "torch-cpu": "torch CPU tensors",
    "jax-cpu": "JAX arrays",
    "dask": "Dask arrays",
}
#: The feature maps an executor can declare: none (exact sparse attention), a random map
#: (any kind but the fitted one) or a fitted map (``kind="hedgehog"``).
MapKind = Literal["none", "random", "fitted"]
_MAP_REASONS: dict[MapKind, str] = {
    "none": "no feature map (exact sparse attention merges its parts)",
    "random": "no fitted map (a random one)",
    "fitted": "a fitted map",
}


def library(x: object) -> Library | None:
    """The declared library ``x`` belongs to, or ``None`` (another library or device).

    Read from the type and device only: nothing is computed (the plan runs inside
    ``torch.compile``'s tracing too).

    Examples
    --------
    >>> import numpy as np
    >>> library(np.zeros(3)), library([1.0])
    ('numpy', None)
    """
    if type(x) is np.ndarray:
        return "numpy"
    if (
        _dispatch.library_of(x) == "torch"
        and getattr(getattr(x, "device", None), "type", None) == "cpu"
    ):
        return "torch-cpu"
    if is_jax_array(x):
        import jax

        return "jax-cpu" if jax.default_backend() == "cpu" else None
    if is_dask_array(x):
        return "dask"
    return None


def map_kind(feature_map: FeatureMap | None) -> MapKind:
    """``"none"``, ``"fitted"`` (a map with fitted parameters) or ``"random"``."""
    if feature_map is None:
        return "none"
    return "fitted" if feature_map.parameters is not None else "random"


@dataclass(frozen=True)
class Takes:
    """What an executor takes, as data; ``None`` is "any".

    Attributes
    ----------
    libraries : tuple of Library or None
        The array libraries (and devices) of ``q``, ``k`` and ``v``.
    causal : bool or None
        Causal calls only (``True``), bidirectional only (``False``).
    exact_parts : bool or None
        Calls with a window, sink keys or exact keys only (``True``), without (``False``).
    window : bool or None
        Calls with a window only (``True``), without (``False``).
    state : bool or None
        Calls that continue a state (``True``), or that neither continue nor ask for one
        (``False``).
    maps : tuple of MapKind
        The feature maps it takes.
    dtypes : tuple of str or None
        The dtypes of ``q``, ``k`` and ``v`` (``"float32"``...).
    backends : tuple of str
        The values of ``backend=`` (resolved: the argument, else ``$LINATTN_BACKEND``)
        it serves.
    """

    libraries: tuple[Library, ...] | None = None
    causal: bool | None = None
    exact_parts: bool | None = None
    window: bool | None = None
    state: bool | None = None
    maps: tuple[MapKind, ...] = ("none", "random", "fitted")
    dtypes: tuple[str, ...] | None = None
    backends: tuple[_dispatch.Backend, ...] = _dispatch.BACKENDS

    def admits(self, f: Facts) -> bool:
        """Whether a call with facts ``f`` is inside these declarations but for their
        dtypes (:meth:`reasons` without the words: the plan of a call about to run)."""
        return (
            (self.exact_parts is None or f.exact_parts == self.exact_parts)
            and (self.causal is None or f.causal == self.causal)
            and (self.window is None or f.window == self.window)
            and f.backend in self.backends
            and f.map_kind in self.maps
            and (
                self.state is None
                or (f.stateful if self.state else not (f.stateful or f.asks_state))
            )
            and (self.libraries is None or all(x in self.libraries for x in f.libraries))
        )

    def reasons(self, call: Call, facts: Facts | None = None) -> list[str]:
        """Why a call falls outside these declarations; empty where it does not.
        ``facts``: the call's, where the caller has read them already."""
        f = Facts.of(call) if facts is None else facts
        reasons: list[str] = []
        if self.exact_parts is not None and f.exact_parts != self.exact_parts:
            reasons.append(
                "no window, sink keys or exact keys"
                if self.exact_parts
                else "a window, sink keys or exact keys"
            )
        if self.causal is not None and f.causal != self.causal:
            reasons.append("causal" if f.causal else "bidirectional")
        if self.window is not None and f.window != self.window:
            reasons.append("a window" if f.window else "no window")
        if f.backend not in self.backends:
            source = " ($LINATTN_BACKEND)" if call.backend is None else ""
            reasons.append(f"backend={f.backend!r}{source}")
        if f.map_kind not in self.maps:
            reasons.append(_MAP_REASONS[f.map_kind])
        if self.state is not None:
            if self.state and not f.stateful:
                reasons.append("no state to continue")
            elif not self.state and (f.stateful or f.asks_state):
                reasons.append("a state is asked for or continued")
        if self.libraries is not None and not all(x in self.libraries for x in f.libraries):
            names = " or ".join(LIBRARIES[name] for name in self.libraries)
            reasons.append(f"not {names}")
            return reasons  # (their dtypes are not read)
        if self.dtypes is not None:
            for name, x in (("q", call.q), ("k", call.k), ("v", call.v)):
                dtype = dtype_name(x.dtype).removeprefix("torch.")
                if dtype not in self.dtypes:
                    reasons.append(f"{name} is {dtype}, not {' or '.join(self.dtypes)}")
                    break
        return reasons


class Facts(NamedTuple):
    """What the declarations of :class:`Takes` are checked against, read once per call
    (the plan asks every executor about the same call)."""

    exact_parts: bool
    causal: bool
    window: bool
    backend: _dispatch.Backend
    map_kind: MapKind
    stateful: bool
    asks_state: bool
    libraries: tuple[Library | None, ...]  # of q, k and v

    @classmethod
    def of(cls, call: Call) -> Facts:
        """The facts of ``call``."""
        return cls(
            call.exact_parts,
            bool(call.causal),
            call.window is not None,
            _dispatch.resolve_backend(call.backend),
            map_kind(call.feature_map),
            call.state is not None,
            call.return_state is not False,
            (library(call.q), library(call.k), library(call.v)),
        )


class Executor:
    """One way to run a call of :func:`linattn.linear_attention`.

    Subclasses set :attr:`name`, :attr:`summary` (why it serves a call it takes) and
    :attr:`takes`, implement :meth:`run`, and may add :meth:`more_reasons` and a
    :meth:`backward`.  One module of :mod:`linattn.executors` each.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    takes: ClassVar[Takes] = Takes()
    #: Whether it runs compiled kernels on every call it serves.
    compiled: ClassVar[bool] = False

    def why_not(self, call: Call, scan: _dispatch.Plan, facts: Facts | None = None) -> list[str]:
        """Every reason this executor does not serve ``call`` (empty: it does).

        The declarations' reasons first; the executor's own only where those hold (they
        may read what the declarations guarantee: a library, a dtype).  ``facts``: the
        call's (:meth:`Facts.of`), where the caller has read them already.
        """
        return self.takes.reasons(call, facts) or self.more_reasons(call, scan)

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        """Reasons beyond the declarations (a kernel that must import, a length limit)."""
        return []

    def uses_kernels(self, call: Call, scan: _dispatch.Plan) -> bool:
        """Whether running ``call`` (which it serves) reaches a compiled kernel: always
        where :attr:`compiled`, else where the scan plan is a kernel's."""
        return self.compiled or scan.path == "numba-cpu"

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        """The output in the caller's dtype, and the new state where asked."""
        raise NotImplementedError

    def backward(self, call: Call) -> Backward | None:
        """This executor's own backward for ``call`` (which it serves), or ``None``: the
        portable adjoint of :func:`linattn.linear_attention_vjp` then runs."""
        return None

    def __repr__(self) -> str:
        return f"<executor {self.name}>"
