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

This follows numbagg (``numbagg/decorators.py``).

Every kernel uses Numba's on-disk compile cache, in the directory that
:mod:`linattn_numba._cache` resolves (on by default; ``LINATTN_NUMBA_CACHE=0`` turns it
off); a kernel missing from the cache compiles under that directory's lock.  The serial
twin is cached apart from the parallel kernel: Numba keys a cache entry by function and
signature, not by ``parallel``, so without a name of its own the twin would load the
parallel kernel from the cache.  Each compilation (or load from the cache) of a kernel is
logged at ``DEBUG`` on the ``linattn.numba`` logger, with the extra attributes ``kernel``,
``variant``, ``dtype``, ``seconds`` and ``source`` (``"compiled"`` or ``"cache"``); the
first compilation in a process logs a one-line notice at ``WARNING``
(``logging.getLogger("linattn").setLevel(logging.ERROR)`` silences it).

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

import logging
import os
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numba
from numba import njit
from numba.core import event as _numba_event
from numba.core.compiler_lock import global_compiler_lock
from numba.np.ufunc import parallel as _numba_parallel

from linattn_numba import _cache

__all__ = [
    "CACHE",
    "CACHE_SETTING",
    "CACHE_VARIABLE",
    "SERIAL_WORK",
    "Variants",
    "choose_variant",
    "describe",
    "describe_cache",
    "jit",
    "logger",
    "serial_reason",
    "single_threaded_blas",
    "threading_layer",
]

CACHE_VARIABLE = _cache.VARIABLE
_CONFIG: Any = numba.config  # (its settings are set at import: mypy cannot see them)

#: The compile cache's directory (``None``: no cache) and why (read once, at import).
CACHE_SETTING = _cache.resolve(os.environ, str(_CONFIG.CACHE_DIR or ""))
#: Whether the kernels use Numba's on-disk compile cache.
CACHE = CACHE_SETTING.directory is not None

#: Work below which the kernels run serial, in token-heads times state entries
#: (``batch * L * m * (d_v + 1)``, about the multiply-adds of the state updates).  About
#: 500 token-heads at ``m = 256, d = 64`` (2 ms serial): below it a parallel launch
#: saves at most about a millisecond on a quiet machine, but costs several where other
#: processes hold the cores (a worker thread waits for a time slice); measured in
#: ``docs/backends.md``.
SERIAL_WORK = 2**23

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
    """``numba.njit`` with the kernels' options: no GIL, NumPy's error model, the compile
    cache of :data:`CACHE_SETTING`, and by default only multiply-add fusion as fast-math
    (no flag that assumes finite values)."""

    def decorate(func: Callable[..., Any]) -> Any:
        dispatcher = njit(
            nogil=True, fastmath=set(fastmath), error_model="numpy", parallel=parallel
        )(func)
        if CACHE_SETTING.directory is not None:
            _cache.attach(dispatcher, CACHE_SETTING.directory)
        _instrument(dispatcher)
        return dispatcher

    return decorate


class Variants:
    """A kernel compiled as ``parallel=True`` and as a serial twin; run one by name.

    Each variant compiles on its first call (a call path compiles only the variants it
    runs).  The twin is a copy of the function named ``<name>_serial``: its own entry in
    the compile cache.  ``launches`` counts the calls of each variant (for tests and
    diagnostics).
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__
        self.dispatchers = {"parallel": jit(parallel=True)(func), "serial": jit()(_twin(func))}
        self.launches: Counter[str] = Counter()

    def run(self, variant: str, *args: Any) -> Any:
        """Call the ``variant`` (``"parallel"`` or ``"serial"``) on ``args``."""
        dispatcher = self.dispatchers[variant]
        self.launches[variant] += 1
        return dispatcher(*args)


def _twin(func: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``func`` named ``<name>_serial`` (Numba's cache files and index are named
    by the function's qualified name and line, and not told ``parallel`` apart)."""
    twin = types.FunctionType(
        func.__code__, func.__globals__, f"{func.__name__}_serial", func.__defaults__,
        func.__closure__,
    )  # fmt: skip
    twin.__qualname__ = f"{func.__qualname__}_serial"
    twin.__doc__ = func.__doc__
    return twin


# -- compiling: the lock, the log and the notice -------------------------------------------

logger = logging.getLogger("linattn.numba")
# Kernels being compiled in this process (a kernel compiles its callees inside its own
# compilation; only the outermost is logged).  Changed under Numba's compiler lock only.
_COMPILING = {"depth": 0}
# Whether this process has logged the notice that kernels compile.
_NOTICE = {"given": False}


def _instrument(dispatcher: Any) -> None:
    """Log each outermost compilation of ``dispatcher``, or load from the cache, and release
    the cache's lock when it ends (a miss takes it: ``_cache.LockedCache``)."""
    compile_ = dispatcher.compile

    def compile(sig: Any) -> Any:
        with global_compiler_lock:  # (what compile_ takes too: one compilation at a time)
            stats = dispatcher.stats
            before = (sum(stats.cache_misses.values()), sum(stats.cache_hits.values()))
            start, done = time.perf_counter(), False
            _COMPILING["depth"] += 1
            try:
                entry = compile_(sig)
                done = True
                return entry
            finally:
                _COMPILING["depth"] -= 1
                if _COMPILING["depth"] == 0:
                    _cache.release()
                    if done:
                        _log_compilation(dispatcher, sig, before, time.perf_counter() - start)

    dispatcher.compile = compile


def _log_compilation(dispatcher: Any, sig: Any, before: tuple[int, int], seconds: float) -> None:
    stats = dispatcher.stats
    if sum(stats.cache_misses.values()) > before[0]:
        source = "compiled"
    elif sum(stats.cache_hits.values()) > before[1]:
        source = "cache"
    else:
        return  # (compiled before, in this process)
    func = dispatcher.py_func
    kernel = f"{func.__module__.removeprefix('linattn_numba.')}.{func.__name__}"
    variant = "parallel" if dispatcher.targetoptions.get("parallel") else "serial"
    types_ = [getattr(arg, "dtype", arg) for arg in getattr(sig, "args", sig)]
    floats = [str(t) for t in types_ if isinstance(t, numba.types.Float)]
    dtype = floats[0] if floats else ""  # (the first float array's or number's)
    logger.debug(
        "%s %s (%s, %s) in %.2f s", source, kernel, variant, dtype, seconds,
        extra={
            "kernel": kernel, "variant": variant, "dtype": dtype, "seconds": seconds,
            "source": source,
        },
    )  # fmt: skip


class _CompileNotice(_numba_event.Listener):
    """Logs, once per process, that kernels compile: the first call waits for it."""

    def on_start(self, event: Any) -> None:
        if _NOTICE["given"]:
            return
        module = getattr(event.data["dispatcher"].py_func, "__module__", "") or ""
        if not module.startswith("linattn_numba."):
            return
        _NOTICE["given"] = True
        directory = CACHE_SETTING.directory
        where = (
            f"cached in {directory} for later processes"
            if directory is not None
            else f"compile cache {CACHE_SETTING.reason}: every process compiles again"
        )
        logger.warning(
            "linattn: compiling the Numba kernels this call needs, once (tens of seconds "
            "or more; %s; `linattn compile` compiles them ahead)",
            where,
        )

    def on_end(self, event: Any) -> None:
        return None


_numba_event.register("numba:compile", _CompileNotice())


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
    return f"threading layer {layer} ({started}; {safety}); {describe_cache()}"


def describe_cache() -> str:
    """The compile cache in words: its directory, where that came from, its size and how
    to clear it; or why there is none.

    Examples
    --------
    >>> describe_cache().startswith("compile cache ")
    True
    """
    directory = CACHE_SETTING.directory
    if directory is None:
        return f"compile cache {CACHE_SETTING.reason}"
    megabytes = _cache.size(directory) / 2**20
    clear = f'rmdir /s /q "{directory}"' if os.name == "nt" else f"rm -rf '{directory}'"
    return (
        f"compile cache on: {directory} ({CACHE_SETTING.reason}; {megabytes:.1f} MB; "
        f"clear: {clear}; {CACHE_VARIABLE}=0 turns it off)"
    )


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
