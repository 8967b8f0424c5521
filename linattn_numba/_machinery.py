"""How the CPU kernels are compiled and launched, so that the kernel bodies need not know.

Every kernel is compiled once per signature, serial and without the GIL
(:func:`jit`).  A kernel over batch x heads (:class:`Variants`) runs one of two ways,
chosen per call by :func:`choose_variant`:

* ``"serial"``: on the calling thread;
* ``"parallel"``: the batch axis cut into :func:`threads` contiguous shares, the calling
  thread running the first and a pool of Python threads (:data:`POOL_NAME`) the others,
  each share the same compiled kernel on its slice of the arrays.

The parallel form used to be Numba's ``parallel=True`` (``prange``), compiled twice
(parallel and serial twin) and through the parfor passes: 17.1 s to compile the fused
causal pass against 11.4 s serial, measured in one run, for a run time within 1 % at 16K
tokens x 8 heads (docs/performance.md, "Compiling in seconds").  The pool is
plain Python threads: safe from any thread and in a forked child (which starts a pool of
its own), where Numba's ``workqueue`` layer aborted and GNU OpenMP killed the child.
Small work runs serial: a one-token decode step, a few heads, where handing work to
another thread costs more than it saves, and under contention far more
(:data:`SERIAL_WORK`).

Every kernel uses Numba's on-disk compile cache, in the directory that
:mod:`linattn_numba._cache` resolves (on by default; ``LINATTN_NUMBA_CACHE=0`` turns it
off); a kernel missing from the cache compiles under that directory's lock.  Each
compilation (or load from the cache) of a kernel is logged at ``DEBUG`` on the
``linattn.numba`` logger, with the extra attributes ``kernel``, ``dtype``, ``seconds``
and ``source`` (``"compiled"`` or ``"cache"``); the first compilation in a process logs
a one-line notice at ``WARNING``
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

import concurrent.futures
import inspect
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numba
from numba import njit
from numba.core import event as _numba_event
from numba.core.compiler_lock import global_compiler_lock

from linattn_numba import _cache

__all__ = [
    "CACHE",
    "CACHE_SETTING",
    "CACHE_VARIABLE",
    "POOL_NAME",
    "SERIAL_WORK",
    "Variants",
    "choose_variant",
    "describe",
    "describe_cache",
    "jit",
    "logger",
    "serial_reason",
    "single_threaded_blas",
    "threads",
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

#: The name prefix of the pool's threads (:func:`threads` - 1 of them, started on the
#: first parallel call; the calling thread runs the first share).
POOL_NAME = "linattn-kernel"
# The pool, made on first use; a forked child drops its parent's (whose threads it lacks).
_POOL: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def threads() -> int:
    """The threads a parallel kernel runs on: ``NUMBA_NUM_THREADS`` (Numba's setting; by
    default the CPUs this process may use).

    Examples
    --------
    >>> threads() >= 1
    True
    """
    return max(1, int(_CONFIG.NUMBA_NUM_THREADS))


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    with _POOL_LOCK:
        if "pool" not in _POOL:
            _POOL["pool"] = concurrent.futures.ThreadPoolExecutor(
                max(1, threads() - 1), thread_name_prefix=POOL_NAME
            )
        return _POOL["pool"]


os.register_at_fork(after_in_child=_POOL.clear)


def jit(fastmath: frozenset[str] = frozenset({"contract"})) -> Any:
    """``numba.njit`` with the kernels' options: no GIL, NumPy's error model, the compile
    cache of :data:`CACHE_SETTING`, and by default only multiply-add fusion as fast-math
    (no flag that assumes finite values)."""

    def decorate(func: Callable[..., Any]) -> Any:
        dispatcher = njit(nogil=True, fastmath=set(fastmath), error_model="numpy")(func)
        if CACHE_SETTING.directory is not None:
            _cache.attach(dispatcher, CACHE_SETTING.directory)
        _instrument(dispatcher)
        return dispatcher

    return decorate


class Variants:
    """A kernel over batch x heads, compiled once, run serial or parallel by name.

    ``func``'s first argument, and every array argument not named in ``shared`` or
    ``workers``, has the batch axis first: a parallel run hands each thread its slice
    of them.  ``shared`` arrays (a projection, constants) go whole to every thread;
    ``workers`` arrays (scratch with one row per worker) give each thread its own row.
    Scalars go to every thread as they are.  ``launches`` counts
    the calls of each variant (for tests and diagnostics).

    Examples
    --------
    >>> from linattn_numba.cpu import fused_causal
    >>> kernel = fused_causal._forward_fused  # (its projection and constants are shared)
    >>> kernel.dispatchers["parallel"] is kernel.dispatchers["serial"]  # one compiled kernel
    True
    """

    def __init__(
        self,
        func: Callable[..., Any],
        shared: tuple[str, ...] = (),
        workers: tuple[str, ...] = (),
    ) -> None:
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__
        names = list(inspect.signature(func).parameters)
        unknown = sorted((set(shared) | set(workers)) - set(names))
        if unknown:
            raise ValueError(f"{func.__name__} has no arguments {unknown}")
        self._shared = frozenset(names.index(name) for name in shared)
        self._workers = frozenset(names.index(name) for name in workers)
        self.dispatcher = jit()(func)
        #: (One compiled kernel runs both variants.)
        self.dispatchers = {"parallel": self.dispatcher, "serial": self.dispatcher}
        self.launches: Counter[str] = Counter()

    @classmethod
    def over(
        cls, *, shared: tuple[str, ...] = (), workers: tuple[str, ...] = ()
    ) -> Callable[[Callable[..., Any]], Variants]:
        """The decorator of a kernel with ``shared`` and ``workers`` arguments."""
        return lambda func: cls(func, shared, workers)

    def run(self, variant: str, *args: Any) -> None:
        """Call the ``variant`` (``"parallel"`` or ``"serial"``) on ``args``."""
        self.launches[variant] += 1
        batch = args[0].shape[0]
        count = min(batch, threads()) if variant == "parallel" else 1
        if count <= 1:
            self.dispatcher(*args)
            return
        edges = [batch * i // count for i in range(count + 1)]
        shares = [self._share(args, i, edges[i], edges[i + 1]) for i in range(count)]
        pool = _pool()
        futures = [pool.submit(self.dispatcher, *share) for share in shares[1:]]
        try:
            self.dispatcher(*shares[0])
        finally:
            for future in futures:
                future.result()

    def _share(self, args: tuple[Any, ...], worker: int, start: int, stop: int) -> list[Any]:
        return [
            x if i in self._shared or getattr(x, "ndim", 0) == 0
            else x[worker : worker + 1] if i in self._workers
            else x[start:stop]
            for i, x in enumerate(args)
        ]  # fmt: skip


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
    types_ = [getattr(arg, "dtype", arg) for arg in getattr(sig, "args", sig)]
    floats = [str(t) for t in types_ if isinstance(t, numba.types.Float)]
    dtype = floats[0] if floats else ""  # (the first float array's or number's)
    logger.debug(
        "%s %s (%s) in %.2f s", source, kernel, dtype, seconds,
        extra={"kernel": kernel, "dtype": dtype, "seconds": seconds, "source": source},
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


def describe() -> str:
    """The kernels' threads and the cache setting (for ``linattn info``)."""
    count = threads()
    return (
        f"{count} kernel thread{'s' if count != 1 else ''} (batch x heads split over a pool "
        f"of Python threads; NUMBA_NUM_THREADS sets it; thread- and fork-safe); "
        f"{describe_cache()}"
    )


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


def serial_reason(batch: int, length: int, state_size: int) -> str | None:
    """Why a kernel over ``batch`` heads of ``length`` tokens, each head's state of
    ``state_size = m * (d_v + 1)`` entries, runs serial here and now; ``None`` when it
    runs parallel."""
    if batch < 2:
        return "one head"
    work = batch * length * state_size
    if work < SERIAL_WORK:
        return f"small work ({work} < SERIAL_WORK = {SERIAL_WORK})"
    if threads() < 2:
        return "one kernel thread"
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
