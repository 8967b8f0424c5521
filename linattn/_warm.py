"""Compiling in the background: a NumPy call whose kernels are not compiled yet runs on
the portable path while another process compiles them into the compile cache.

The first call of a kernel compiles it (seconds to tens of seconds); later processes load
it from the compile cache in about a second.  With ``backend="auto"`` (the default) a
call of NumPy arrays that would run compiled kernels which are neither in this process
nor in the cache does not wait for them: the plan takes the portable path (the array
API: the same results, rounded differently, slower on long inputs), and a background
process (``python -m linattn.cli._warm_job``, detached, under the cache's lock) runs the
same kind of call with ``backend="numba"``, which compiles the kernels into the cache.
Its marker file tells every later call, in this process or another, that the kernels are
ready; from then on calls run them (the first loads them from the cache).

Where it applies:

* mode :data:`VARIABLE` = ``background`` (the default); ``foreground`` compiles in the
  call, as an explicit ``backend="numba"`` always does (tests pin it, benchmarks too);
* NumPy arrays (torch tensors, JAX and Dask compile or trace in the call);
* a compile cache that is on (:func:`linattn._dispatch.cache_directory`): without one a
  background process could not hand its kernels over.

A background compile that fails leaves a ``.failed`` marker with its error; calls of that
kind then compile in the call, which raises where the kernel cannot run.  ``linattn
compile`` warms the kernels ahead (a container's build step), as before.

Examples
--------
>>> mode({"LINATTN_COMPILE": "foreground"})
'foreground'
>>> mode({})
'background'
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from linattn import _dispatch
from linattn._call import Call

__all__ = [
    "JOB_MAX_LENGTH",
    "JOB_MODULE",
    "MAX_JOBS",
    "MODES",
    "REASON",
    "STALE_SECONDS",
    "VARIABLE",
    "cold",
    "foreground",
    "mode",
    "reset",
    "wait",
]

#: The environment variable that picks the mode: ``background`` or ``foreground``.
VARIABLE = "LINATTN_COMPILE"
MODES = ("background", "foreground")
#: What the plan says of a compiled executor passed over while its kernels compile.
REASON = "compiling in the background: portable path until ready"
#: The module a background compile runs (``python -m``).
JOB_MODULE = "linattn.cli._warm_job"
#: Inputs longer than this are cut to it in the background job (the kernels' types do
#: not depend on the length; a stateful call keeps its length).
JOB_MAX_LENGTH = 1024
#: A background job still marked as running after this long is taken for dead.
STALE_SECONDS = 900.0
#: Background jobs of one cache running at once (each is a Python process with Numba,
#: a few hundred MB; they compile one after another under the cache's lock anyway): a
#: script with many kinds of calls starts the others as these end.
MAX_JOBS = 2

# Per kind of call (its key): True once its kernels may run in this process.
_READY: dict[tuple[Any, ...], bool] = {}
# Kinds whose background compile this process started (or found started).
_STARTED: set[tuple[Any, ...]] = set()
_LOCK = threading.Lock()


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """The mode :data:`VARIABLE` sets (``background`` where it is not set)."""
    value = environ.get(VARIABLE, "background").strip().lower() or "background"
    if value not in MODES:
        raise ValueError(f"${VARIABLE} must be one of {MODES}; got {value!r}")
    return value


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Kernels compile in the call while the block runs (``linattn compile``, whose work
    is compiling, and ``linattn bench``, whose timed calls must run the kernels)."""
    saved = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = "foreground"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = saved


def reset() -> None:
    """Forget what this process knows (tests)."""
    with _LOCK:
        _READY.clear()
        _STARTED.clear()


def _key(executor: str, call: Call) -> tuple[Any, ...]:
    """The kind of call whose kernels one background job compiles: the executor, the
    dtype, and what chooses among a path's kernels (causal, exact parts, a state)."""
    return (
        executor,
        call.q.dtype,
        bool(call.causal),
        call.window is not None,
        call.sink_keys != 0,
        call.exact_key_mask is not None,
        call.state is not None,
        call.return_state is not False,
        call.feature_map is None,
    )


def cold(executor: str, call: Call, *, start: bool = True) -> str | None:
    """:data:`REASON` where ``call``, which ``executor`` would run on compiled kernels,
    should take the portable path while they compile in the background (started here,
    once per kind of call, unless ``start=False``: a plan only explained); ``None``
    where it runs its kernels now (a call about to run then compiles or loads them: its
    kind is ready in this process from then on, and asks nothing more)."""
    key = _key(executor, call)
    if _READY.get(key):
        return None
    directory = None
    if (
        call.backend in (None, "auto")
        and _dispatch.resolve_backend(call.backend) == "auto"
        and _dispatch.library_of(call.q) == "numpy"
        and mode() == "background"
    ):
        directory = _dispatch.cache_directory()
    if directory is None:  # (the kernels compile in the call)
        if start:
            _READY[key] = True
        return None
    stem = directory / "warm" / _digest(key)
    if stem.with_suffix(".ready").exists() or stem.with_suffix(".failed").exists():
        _READY[key] = True  # (ready: load from the cache; failed: compile in the call)
        return None
    if not start:
        return REASON
    with _LOCK:
        if key not in _STARTED and _running(stem.parent) < MAX_JOBS:
            _STARTED.add(key)
            if not _start(stem, call):
                _READY[key] = True
                return None
    return REASON  # (with MAX_JOBS running already: a later call starts this one)


def _running(folder: Path) -> int:
    """Background jobs of this cache running now (their fresh ``.pending`` markers)."""
    now = time.time()
    return sum(now - _mtime(p) < STALE_SECONDS for p in folder.glob("*.pending"))


def wait(timeout: float = 600.0, poll: float = 0.2) -> float:
    """Wait until no background compile of this cache is running (at most ``timeout``
    seconds); the seconds waited."""
    start = time.monotonic()
    directory = _dispatch.cache_directory()
    if directory is None:
        return 0.0
    while time.monotonic() - start < timeout:
        running = [
            p for p in (directory / "warm").glob("*.pending")
            if time.time() - _mtime(p) < STALE_SECONDS
        ]  # fmt: skip
        if not running:
            break
        time.sleep(poll)
    return time.monotonic() - start


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _stamp() -> str:
    """What the kernels' compiled code depends on besides the call: the versions and
    the kernels' sources (their sizes and times)."""
    parts = [sys.version, _version("linattn"), _version("numba")]
    for path in sorted(_dispatch.kernel_sources()):
        with contextlib.suppress(OSError):
            info = path.stat()
            parts.append(f"{path.name}:{info.st_size}:{info.st_mtime_ns}")
    return "\n".join(parts)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


_STAMP: list[str] = []


def _digest(key: tuple[Any, ...]) -> str:
    if not _STAMP:
        _STAMP.append(_stamp())
    return hashlib.sha256(f"{_STAMP[0]}\n{key!r}".encode()).hexdigest()[:24]


def _job(call: Call) -> dict[str, Any]:
    """What the background job needs to make a call of the same kind: shapes, dtypes,
    the map, the options and the state (no input values: it computes on zeros)."""
    stateful = call.state is not None

    def shape(x: Any) -> tuple[int, ...] | None:
        if x is None:
            return None
        dims = list(x.shape)
        if not stateful and len(dims) >= 2 and x is not call.key_mask:
            dims[-2] = min(dims[-2], JOB_MAX_LENGTH)
        elif not stateful and x is call.key_mask:
            dims[-1] = min(dims[-1], JOB_MAX_LENGTH)
        return tuple(dims)

    return {
        "dtype": str(call.q.dtype),
        "shapes": {name: shape(getattr(call, name)) for name in ("q", "k", "v")},
        "key_mask": shape(call.key_mask),
        "feature_map": call.feature_map,
        "options": {
            "causal": call.causal, "state": call.state, "return_state": call.return_state,
            "chunk_size": call.chunk_size, "window": call.window,
            "sink_keys": call.sink_keys, "scale": call.scale,
        },
        "exact_key_mask": shape(call.exact_key_mask),
    }  # fmt: skip


def _start(stem: Path, call: Call) -> bool:
    """Write the job next to its markers and start the detached process that runs it
    (nothing where another process's job for this kind is running); False where no
    background compile can start (calls of this kind then compile in the call)."""
    pending = stem.with_suffix(".pending")
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        if pending.exists() and time.time() - pending.stat().st_mtime < STALE_SECONDS:
            return True  # (another process is compiling these kernels)
        with tempfile.NamedTemporaryFile(dir=stem.parent, suffix=".tmp", delete=False) as f:
            pickle.dump(_job(call), f)
        os.replace(f.name, stem.with_suffix(".job"))
        pending.write_text(str(os.getpid()))
        environment = {**os.environ, VARIABLE: "foreground"}
        environment.pop(_dispatch.ENVIRONMENT_VARIABLE, None)
        with open(stem.with_suffix(".log"), "w") as log:
            subprocess.Popen(
                [sys.executable, "-m", JOB_MODULE, str(stem)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=environment,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        # (a directory that cannot be written, a map that cannot be pickled)
        with contextlib.suppress(OSError):
            pending.unlink()
        return False
    return True
