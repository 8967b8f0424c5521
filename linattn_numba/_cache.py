"""The kernels' on-disk compile cache: where it lives, and the lock that lets processes share it.

The cache is on by default.  Its directory, first rule that applies:

1. ``LINATTN_NUMBA_CACHE=0`` (or ``off``, ``false``, ``no``): no cache, whatever else is set;
2. ``NUMBA_CACHE_DIR`` (``numba.config.CACHE_DIR``), Numba's own setting, as it is;
3. ``LINATTN_NUMBA_CACHE=<absolute directory>``;
4. the user's cache directory: ``$XDG_CACHE_HOME/linattn/numba/<versions>``, or
   ``~/.cache/...`` where ``XDG_CACHE_HOME`` is not set (``~/Library/Caches`` on macOS,
   ``%LOCALAPPDATA%`` on Windows), ``<versions>`` naming linattn's and Numba's versions
   and a digest of the kernels' sources (:func:`sources_digest`).

A directory that cannot be created or written means no cache, without an error (Numba
itself would fall back to ``__pycache__`` beside the sources, or its own user-wide
directory: the kernels never do).

Numba's cache is not safe for processes compiling the same functions at once (numba issue
4807: each process rewrites a function's index from the copy it read, so two processes can
give one data file to two signatures).  A kernel that is not in the cache is compiled and
saved under an exclusive lock on a file in the directory (:class:`LockedCache`): processes
compile one after another, a process that waited looks in the cache again and loads what
the other compiled, and loads from a warm cache take no lock.

Examples
--------
>>> resolve({"LINATTN_NUMBA_CACHE": "0"}, numba_cache_dir="")
Setting(directory=None, reason='off (LINATTN_NUMBA_CACHE=0)')
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "LOCK_NAME",
    "VARIABLE",
    "LockedCache",
    "Setting",
    "attach",
    "default_directory",
    "hold",
    "release",
    "resolve",
    "size",
    "sources_digest",
]

VARIABLE = "LINATTN_NUMBA_CACHE"
#: The lock file inside the cache directory (see :func:`hold`).
LOCK_NAME = ".linattn-compile.lock"
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")

logger = logging.getLogger("linattn.numba")


class Setting(NamedTuple):
    """The cache's directory (``None``: no cache) and where that came from, in words."""

    directory: Path | None
    reason: str


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def default_directory(environ: Mapping[str, str]) -> Path:
    """The user's cache directory for the kernels (the XDG rule; macOS and Windows have
    their own places).

    Examples
    --------
    >>> default_directory({"XDG_CACHE_HOME": "/c"}).parts[-3:-1]
    ('linattn', 'numba')
    """
    if sys.platform == "win32" and environ.get("LOCALAPPDATA"):
        base = Path(environ["LOCALAPPDATA"])
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    versions = f"{_version('linattn')}-numba-{_version('numba')}-{sources_digest()}"
    return base / "linattn" / "numba" / versions


def sources_digest() -> str:
    """A digest of the kernels' source files (every ``.py`` of ``linattn_numba``).

    Numba keys a cache entry by its function's own file only: a kernel whose callee in
    another file changed loaded its old compiled code, callee and all (an edited
    ``exact.merge_into`` kept running inside the cached ``bidirectional._forward``).  The
    default directory names this digest, so that any change to the kernels' sources
    starts a fresh cache (an explicit ``NUMBA_CACHE_DIR`` or ``LINATTN_NUMBA_CACHE`` is
    the caller's to keep apart).

    Examples
    --------
    >>> len(sources_digest())
    12
    """
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        with contextlib.suppress(OSError):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _writable(directory: Path) -> str | None:
    """``None`` when ``directory`` exists (or was made) and takes a file, else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except (OSError, ValueError) as error:  # (ValueError: a NUL in the path)
        return f"{type(error).__name__}: {error}"
    return None


def resolve(environ: Mapping[str, str], numba_cache_dir: str) -> Setting:
    """The cache directory the settings ``environ`` and ``numba_cache_dir``
    (``numba.config.CACHE_DIR``) ask for, made if missing; ``None`` and the reason where
    there is none or it cannot be written.

    Examples
    --------
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> resolve({}, numba_cache_dir=folder).reason
    'NUMBA_CACHE_DIR'
    >>> resolve({"LINATTN_NUMBA_CACHE": "off"}, numba_cache_dir=folder).directory is None
    True
    """
    value = environ.get(VARIABLE, "").strip()
    if value.lower() in _OFF:
        return Setting(None, f"off ({VARIABLE}={value})")
    if numba_cache_dir:
        directory, reason = Path(numba_cache_dir), "NUMBA_CACHE_DIR"
    elif value.lower() in _ON:
        directory, reason = default_directory(environ), "the user's cache directory"
    else:
        directory, reason = Path(value).expanduser(), VARIABLE
        if not directory.is_absolute():
            return Setting(
                None, f"off: {VARIABLE}={value!r} is neither 0, 1 nor an absolute directory"
            )
    directory = directory.absolute()  # (the process may change its directory later)
    problem = _writable(directory)
    if problem is not None:
        return Setting(None, f"off: {directory} ({reason}) cannot be written: {problem}")
    return Setting(directory, reason)


def size(directory: Path) -> int:
    """Bytes in the files under ``directory`` (0 where it does not exist)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # (removed meanwhile)
                total += os.stat(os.path.join(root, name)).st_size
    return total


# -- the lock ----------------------------------------------------------------------------

# The lock file this process holds locked (exclusive), if any.  Taken and released under
# Numba's global compiler lock only, which every compilation holds.
_HELD: dict[str, Any] = {"handle": None}


def hold(directory: Path) -> None:
    """Hold the exclusive lock of the cache in ``directory`` until :func:`release`
    (nothing where this process holds it already; other processes wait).  A lock that
    cannot be taken (no ``fcntl``, a file system without locks) is not held, without an
    error.

    Examples
    --------
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> hold(folder); hold(folder)  # (the second: held already, no wait)
    >>> (folder / LOCK_NAME).exists()
    True
    >>> release()
    """
    if _HELD["handle"] is None:
        _HELD["handle"] = _acquire(directory / LOCK_NAME) or False


def release() -> None:
    """Release the lock :func:`hold` took, if any."""
    handle, _HELD["handle"] = _HELD["handle"], None
    if handle:
        handle.close()  # (releases the lock)


def _acquire(path: Path) -> Any:
    """The open lock file at ``path``, locked; ``None`` where no lock can be taken."""
    try:
        import fcntl
    except ImportError:  # (Windows)
        return None
    try:
        handle = open(path, "a+b")  # noqa: SIM115 (closed by ``release``)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process compiling into %s", path.parent)
            fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError:
        handle.close()
        return None
    return handle


class LockedCache:
    """A kernel's Numba cache whose misses take the directory's lock (:func:`hold`), and
    whose damaged entries heal.

    A load from the cache takes no lock: Numba replaces each file whole, and a writer holds
    the lock.  A miss holds it and looks again (another process may have just written the
    kernel); the lock is then held while the kernel compiles and is saved, until
    :func:`release` (``linattn_numba._machinery`` calls it when the outermost compilation
    ends).

    An entry that cannot be loaded (an index or data file truncated, emptied or garbled:
    an interrupted write, a full disk) is a miss: under the lock its files are removed, one
    warning says so, and the kernel compiles and is saved afresh.  Numba raised instead,
    in every later call of every process, until the cache was deleted by hand.
    """

    def __init__(self, cache: Any, directory: Path) -> None:
        self.cache = cache
        self.directory = directory

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        found = self._load(sig, target_context)
        if found is None and _HELD["handle"] is None:
            hold(self.directory)
            found = self._load(sig, target_context)
        return found

    def _load(self, sig: Any, target_context: Any) -> Any:
        try:
            return self.cache.load_overload(sig, target_context)
        except Exception as error:  # (whatever unpickling a damaged file raises)
            hold(self.directory)
            removed = self.drop()
            logger.warning(
                "linattn: the compile cache entry of %s could not be loaded (%s: %s); "
                "removed %d file(s), compiling it again",
                getattr(getattr(self.cache, "_py_func", None), "__qualname__", "a kernel"),
                type(error).__name__, error,
                len(removed),
            )  # fmt: skip
            return None

    def drop(self) -> list[Path]:
        """Remove this kernel's index and data files; the paths removed."""
        files = self.cache._cache_file
        folder = Path(files._cache_path)
        index = Path(files._index_path)
        pattern = files._data_name_pattern.replace("{number:d}", "*")
        removed = []
        for path in [index, *folder.glob(pattern)]:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        return removed

    def __getattr__(self, name: str) -> Any:  # (save_overload, cache_path, flush, ...)
        return getattr(self.cache, name)


# -- attaching the cache to a kernel ------------------------------------------------------


def attach(dispatcher: Any, directory: Path) -> bool:
    """Turn on ``dispatcher``'s compile cache in ``directory``, its misses under the lock
    (:class:`LockedCache`); ``False`` (and no cache) where Numba chose another directory
    (``directory`` became unwritable since :func:`resolve`, and Numba fell back to
    ``__pycache__``)."""
    from numba.core import config as numba_config
    from numba.core.caching import NullCache
    from numba.core.compiler_lock import global_compiler_lock

    config: Any = numba_config  # (its settings are set at import: mypy cannot see them)
    with global_compiler_lock:  # (no other thread compiles while the setting is changed)
        saved = config.CACHE_DIR
        config.CACHE_DIR = str(directory)
        try:
            dispatcher.enable_caching()
        finally:
            config.CACHE_DIR = saved
    path = dispatcher.stats.cache_path
    if path is None or not Path(path).is_relative_to(directory):
        dispatcher._cache = NullCache()  # (what ``njit(cache=False)`` holds)
        return False
    dispatcher._cache = LockedCache(dispatcher._cache, directory)
    return True
