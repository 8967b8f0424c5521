"""How the CPU kernels are compiled and launched, so that the kernel bodies need not know.

Every ``parallel=True`` kernel is compiled twice (:class:`Variants`): the parallel one
runs batch x heads on Numba's thread pool, the serial one (``prange`` as ``range``) on
the calling thread.  :func:`choose_variant` picks per call; the serial variant runs

* in a forked child whose parent had started a thread pool that is not fork-safe
  (GNU OpenMP: the child would be killed, and ``multiprocessing.Pool`` would hang);
* on a thread other than the main one when the threading layer is not thread-safe
  (``workqueue``: two concurrent launches abort the interpreter, as under a Dask
  threaded scheduler or a ``ThreadPoolExecutor``);
* for small work (a one-token decode step, a few heads), where starting the pool costs
  more than it saves, and under contention far more (:data:`SERIAL_WORK`).

This follows numbagg (``numbagg/decorators.py``).  The compile cache is off unless
``LINATTN_NUMBA_CACHE=1``: processes that compile the same functions at once can race
on Numba's cache files and crash (numba issue 4807).

Examples
--------
>>> from linattn_numba import _machinery
>>> # a one-token decode step on 8 heads, m = 256 features, d_v = 64
>>> _machinery.choose_variant(batch=8, length=1, state_size=256 * 65)
'serial'
>>> _machinery.serial_reason(batch=8, length=1, state_size=256 * 65)
'small work (133120 < SERIAL_WORK = 8388608)'
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numba
from numba import njit
from numba.np.ufunc import parallel as _numba_parallel

__all__ = [
    "CACHE",
    "CACHE_VARIABLE",
    "SERIAL_WORK",
    "Variants",
    "choose_variant",
    "describe",
    "jit",
    "serial_reason",
    "single_threaded_blas",
    "threading_layer",
]

CACHE_VARIABLE = "LINATTN_NUMBA_CACHE"


def _cache_from_environment() -> bool:
    value = os.environ.get(CACHE_VARIABLE, "").strip().lower()
    return value in ("1", "true", "yes", "on")


#: Whether the kernels use Numba's on-disk compile cache (read once, at import).
CACHE = _cache_from_environment()

#: Work below which the kernels run serial, in token-heads times state entries
#: (``batch * L * m * (d_v + 1)``, about the multiply-adds of the state updates).  About
#: 500 token-heads at ``m = 256, d = 64`` (2 ms serial): below it a parallel launch
#: saves at most about a millisecond on a quiet machine, but costs several where other
#: processes hold the cores (a worker thread waits for a time slice); measured in
#: ``docs/backends.md``.
SERIAL_WORK = 2**23

_CONFIG: Any = numba.config  # (its settings are set at import: mypy cannot see them)
_LAYERS = ("tbb", "omp", "workqueue")
_THREAD_SAFE = {"tbb", "omp"}
# GNU OpenMP (Linux) is the one that is not fork-safe; elsewhere OpenMP is.
_FORK_SAFE = {"tbb", "workqueue"} | (set() if sys.platform.startswith("linux") else {"omp"})
_CATEGORIES = {
    "default": set(_LAYERS),
    "safe": {"tbb"},
    "threadsafe": _THREAD_SAFE,
    "forksafe": _FORK_SAFE,
}


def jit(parallel: bool = False, fastmath: frozenset[str] = frozenset({"contract"})) -> Any:
    """``numba.njit`` with the kernels' options: no GIL, NumPy's error model, ``cache``
    from :data:`CACHE`, and by default only multiply-add fusion as fast-math (no flag that
    assumes finite values)."""
    return njit(
        cache=CACHE, nogil=True, fastmath=set(fastmath), error_model="numpy", parallel=parallel
    )


class Variants:
    """A kernel compiled as ``parallel=True`` and as a serial twin; run one by name.

    ``launches`` counts the calls of each variant (for tests and diagnostics).
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__
        self.dispatchers = {"parallel": jit(parallel=True)(func), "serial": jit()(func)}
        self.launches: Counter[str] = Counter()

    def run(self, variant: str, *args: Any) -> Any:
        """Call the ``variant`` (``"parallel"`` or ``"serial"``) on ``args``."""
        dispatcher = self.dispatchers[variant]
        self.launches[variant] += 1
        return dispatcher(*args)


def threading_layer() -> str:
    """Numba's threading layer: the one in use once a parallel kernel ran, else the one
    Numba will pick (``NUMBA_THREADING_LAYER`` and its priority, libraries probed)."""
    if _numba_parallel._is_initialized:
        return str(numba.threading_layer())
    return _predicted_layer(str(_CONFIG.THREADING_LAYER).lower())


def _predicted_layer(requested: str) -> str:
    if requested in _LAYERS:
        return requested
    allowed = _CATEGORIES.get(requested, set(_LAYERS))
    for layer in _CONFIG.THREADING_LAYER_PRIORITY:
        if layer in allowed and _importable(layer):
            return str(layer)
    return "none"


def _importable(layer: str) -> bool:
    if layer == "workqueue":
        return True  # (built into Numba)
    try:  # (importlib.util.find_spec finds the module even where its library is missing)
        __import__(f"numba.np.ufunc.{layer}pool")
    except (ImportError, OSError):
        return False
    return True


def describe() -> str:
    """The threading layer, what it means for the kernels, and the cache setting (for
    ``linattn info``)."""
    layer = threading_layer()
    started = "in use" if _numba_parallel._is_initialized else "starts on the first parallel call"
    unsafe = [
        *([] if layer in _THREAD_SAFE else ["calls from other threads run serial"]),
        *([] if layer in _FORK_SAFE else ["forked children run serial"]),
    ]
    safety = "; ".join(unsafe) if unsafe else "thread- and fork-safe"
    cache = "on" if CACHE else f"off ({CACHE_VARIABLE}=1 turns it on)"
    return f"threading layer {layer} ({started}; {safety}); compile cache {cache}"


# A forked child inherits the parent's thread pool state but not its threads.
_FORK = {"unsafe": False}


def _after_fork_in_child() -> None:
    if _numba_parallel._is_initialized and threading_layer() not in _FORK_SAFE:
        _FORK["unsafe"] = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def serial_reason(batch: int, length: int, state_size: int) -> str | None:
    """Why a kernel over ``batch`` heads of ``length`` tokens, each head's state of
    ``state_size = m * (d_v + 1)`` entries, runs serial here and now; ``None`` when it
    runs parallel."""
    if _FORK["unsafe"]:
        return f"a forked child of a process using the {threading_layer()} thread pool"
    if threading.current_thread() is not threading.main_thread():
        layer = threading_layer()
        if layer not in _THREAD_SAFE:
            return f"called from a thread, and the {layer} threading layer is not thread-safe"
    if batch < 2:
        return "one head"
    work = batch * length * state_size
    if work < SERIAL_WORK:
        return f"small work ({work} < SERIAL_WORK = {SERIAL_WORK})"
    if numba.get_num_threads() < 2:
        return "one Numba thread"
    return None


def choose_variant(batch: int, length: int, state_size: int) -> str:
    """``"serial"`` or ``"parallel"``: the variant that runs ``batch`` heads of ``length``
    tokens with states of ``state_size`` entries (:func:`serial_reason` says why serial)."""
    return "parallel" if serial_reason(batch, length, state_size) is None else "serial"


# -- BLAS -----------------------------------------------------------------------------

# Numba's np.dot calls SciPy's OpenBLAS, whose thread count is process-wide: the first
# kernel call to start pins it to one thread, the last to end restores it, so that
# concurrent calls (thread pools) never leave BLAS pinned.
_BLAS: dict[str, Any] = {"users": 0, "limiter": None}
_BLAS_LOCK = threading.Lock()
_CONTROLLER: list[Any] = []


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS runs single-threaded while any kernel runs (they parallelise over heads)."""
    controller = _blas_controller()
    if controller is None:
        yield
        return
    with _BLAS_LOCK:
        if _BLAS["users"] == 0:
            _BLAS["limiter"] = controller.limit(limits=1, user_api="blas")
        _BLAS["users"] += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS["users"] -= 1
            if _BLAS["users"] == 0:
                _BLAS["limiter"].restore_original_limits()
                _BLAS["limiter"] = None


def _blas_controller() -> Any:
    if not _CONTROLLER:
        try:
            # Numba's np.dot calls the BLAS that SciPy ships: load it before looking.
            import scipy.linalg.cython_blas  # noqa: F401
            from threadpoolctl import ThreadpoolController

            _CONTROLLER.append(ThreadpoolController())
        except ImportError:
            _CONTROLLER.append(None)
    return _CONTROLLER[0]
