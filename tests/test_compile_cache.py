"""The kernels' compile cache (``linattn_numba._cache``): its directory and order of
precedence, no cache (and no error) where the directory cannot be written, and processes
that compile the same kernel at once into an empty directory.

Programs that import the kernels run in a subprocess: the setting is read at import.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

from linattn_numba import _cache, _machinery

ROOT = Path(__file__).resolve().parents[1]


def _environment(**settings: str) -> dict[str, str]:
    """This process's environment without any cache setting, plus ``settings``."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("NUMBA_CACHE_DIR", _cache.VARIABLE, "XDG_CACHE_HOME"):
        environment.pop(name, None)
    environment.update(settings)
    return environment


# -- the order of precedence (no numba needed: the settings as arguments) ------------------


def test_the_default_is_the_users_cache_directory(tmp_path: Path) -> None:
    setting = _cache.resolve({"XDG_CACHE_HOME": str(tmp_path)}, numba_cache_dir="")
    if sys.platform.startswith("linux"):
        assert setting.directory is not None
        assert setting.directory.parent == tmp_path / "linattn" / "numba"
        assert setting.directory.is_dir()  # (made)
    assert _cache.resolve({_cache.VARIABLE: "1"}, numba_cache_dir="").reason == setting.reason


@pytest.mark.parametrize("off", ["0", "off", "False", " no "])
def test_off_wins_over_every_directory(off: str, tmp_path: Path) -> None:
    setting = _cache.resolve({_cache.VARIABLE: off}, numba_cache_dir=str(tmp_path))
    assert setting.directory is None
    assert setting.reason.startswith("off")


def test_numba_cache_dir_then_linattn_numba_cache_then_the_default(tmp_path: Path) -> None:
    numba_dir, own = tmp_path / "numba", tmp_path / "own"
    both = _cache.resolve({_cache.VARIABLE: str(own)}, numba_cache_dir=str(numba_dir))
    assert both == _cache.Setting(numba_dir, "NUMBA_CACHE_DIR")
    assert _cache.resolve({_cache.VARIABLE: str(own)}, "") == _cache.Setting(own, _cache.VARIABLE)


def test_a_relative_or_unknown_value_turns_the_cache_off(tmp_path: Path) -> None:
    setting = _cache.resolve({_cache.VARIABLE: "maybe"}, numba_cache_dir="")
    assert setting.directory is None
    assert "'maybe' is neither 0, 1 nor an absolute directory" in setting.reason


def _unwritable(tmp_path: Path) -> Path:
    """A directory that cannot be made, even by root: its parent is a file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "cache"


def test_an_unwritable_directory_means_no_cache(tmp_path: Path) -> None:
    setting = _cache.resolve({_cache.VARIABLE: str(_unwritable(tmp_path))}, numba_cache_dir="")
    assert setting.directory is None
    assert "cannot be written" in setting.reason
    if os.geteuid() != 0:  # (root writes into read-only directories)
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
        assert _cache.resolve({}, numba_cache_dir=str(read_only)).directory is None


def test_the_lock_is_held_against_other_processes(tmp_path: Path) -> None:
    probe = (
        "import fcntl, sys\n"
        f"handle = open({str(tmp_path / _cache.LOCK_NAME)!r}, 'a+b')\n"
        "try:\n    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except BlockingIOError:\n    sys.exit(3)\n"
    )
    pytest.importorskip("fcntl")
    _cache.hold(tmp_path)
    try:
        _cache.hold(tmp_path)  # (held already: no wait)
        held = subprocess.run([sys.executable, "-c", probe], check=False).returncode
    finally:
        _cache.release()
    free = subprocess.run([sys.executable, "-c", probe], check=False).returncode
    assert (held, free) == (3, 0)


# -- the kernels as imported (subprocesses) ---------------------------------------------------

CACHES = """
import numba
from linattn_numba.cpu import chunks, features, scalars
kernels = [x for m in (chunks, features, scalars) for x in vars(m).values()]
kernels = [x for x in kernels if isinstance(x, numba.core.dispatcher.Dispatcher)]
print(sorted({type(k._cache).__name__ for k in kernels}), len(kernels))
"""


@pytest.mark.parametrize("setting", ["0", "unwritable"])
def test_no_cache_and_no_error(setting: str, tmp_path: Path) -> None:
    """``LINATTN_NUMBA_CACHE=0``, or a directory that cannot be written: no kernel has a
    cache (Numba alone would fall back to ``__pycache__`` beside the sources)."""
    value = str(_unwritable(tmp_path)) if setting == "unwritable" else setting
    env = _environment(**{_cache.VARIABLE: value})
    done = subprocess.run(
        [sys.executable, "-c", CACHES], capture_output=True, text=True, env=env, timeout=120,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    caches, count = done.stdout.split("] ")
    assert caches + "]" == "['NullCache']"
    assert int(count) > 10  # (every compiled function of the modules was looked at)


#: One small kernel, compiled by each process once all of them are ready: prints whether
#: its result is right, and whether it compiled the kernel or loaded it from the cache.
RACE = """
import sys, time
from pathlib import Path
import numpy as np
from linattn_numba.cpu import chunks

rng = np.random.default_rng(int(sys.argv[2]))
lk, mu, top = rng.standard_normal((5, 3)), rng.standard_normal(3), np.empty(3)
Path(sys.argv[1], f"ready-{sys.argv[2]}").touch()
while not Path(sys.argv[1], "go").exists():
    time.sleep(0.002)
chunks.running_max(lk, mu, top)
right = np.array_equal(top, np.maximum(mu, lk.max(axis=0)))
stats = chunks.running_max.stats
print(right, "compiled" if sum(stats.cache_misses.values()) else "loaded")
"""


def test_processes_compiling_at_once_share_the_cache(tmp_path: Path) -> None:
    """Four processes call the same kernel at once on an empty cache: all right, one
    compiles, the others wait for the lock and load its result (without the lock all four
    compile, and write the same files at once: numba issue 4807)."""
    cache, flags = tmp_path / "cache", tmp_path / "flags"
    flags.mkdir()
    env = _environment(**{_cache.VARIABLE: str(cache)})
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(flags), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for seed in range(4)
    ]
    deadline = time.monotonic() + 120
    while len(list(flags.glob("ready-*"))) < 4 and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in processes):
            break
        time.sleep(0.01)
    (flags / "go").touch()
    results = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0] * 4, results
    outputs = sorted(out.strip() for out, _ in results)
    assert outputs == ["True compiled", "True loaded", "True loaded", "True loaded"], results
    # The one that compiled said so on standard error, once; the others said nothing.
    notices = sorted(err.count("linattn: compiling the Numba kernels") for _, err in results)
    assert notices == [0, 0, 0, 1], results
    assert len(list(cache.rglob("chunks.running_max-*.nbc"))) == 1


def test_each_compilation_is_logged_and_the_first_noticed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One record per outermost compilation (what ``linattn compile`` reports), and the
    one-line notice before the first compilation of the process."""
    monkeypatch.setattr(_machinery, "CACHE_SETTING", _cache.Setting(None, "off (test)"))
    monkeypatch.setitem(_machinery._NOTICE, "given", False)

    def twice(x):  # type: ignore[no-untyped-def]
        return x * 2

    twice.__module__ = "linattn_numba.test"  # (the notice is for the kernels only)
    kernel = _machinery.jit()(twice)
    with caplog.at_level(logging.DEBUG, logger="linattn.numba"):
        assert kernel(np.float32(2)) == 4
        assert kernel(np.float32(3)) == 6  # (compiled already: no record)
    records = [r for r in caplog.records if r.name == "linattn.numba"]
    notice, compiled = records
    assert notice.levelno == logging.WARNING
    assert "compiling the Numba kernels" in notice.getMessage()
    assert "compile cache off (test): every process compiles again" in notice.getMessage()
    fields = {k: getattr(compiled, k) for k in ("kernel", "dtype", "source")}
    assert fields == {"kernel": "test.twice", "dtype": "float32", "source": "compiled"}
    assert compiled.levelno == logging.DEBUG
    assert 0 < compiled.seconds < 600


# -- a damaged cache heals -------------------------------------------------------------------

KERNEL_MODULE = """
from linattn_numba import _machinery


def twice(x):
    return 2.0 * x
"""

HEAL = """
import logging, sys
from pathlib import Path
import numpy as np
from linattn_numba import _machinery
import kernel_module

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING and "could not be loaded" in record.getMessage():
            warnings.append(record.getMessage())
logging.getLogger("linattn.numba").addHandler(Keep())
cache = Path(sys.argv[1])


def fresh():  # (a new dispatcher reads the files again, as a new process would)
    return _machinery.jit()(kernel_module.twice)


assert fresh()(np.arange(3.0))[2] == 4.0  # compiled and saved
for damage in ("truncate", "empty", "garble"):
    for suffix in (".nbi", ".nbc"):
        (path,) = cache.rglob("*twice*" + suffix)
        data = path.read_bytes()
        path.write_bytes({"truncate": data[: len(data) // 2], "empty": b"",
                          "garble": bytes(255 - b for b in data)}[damage])
        kernel = fresh()
        assert kernel(np.arange(3.0))[2] == 4.0, (damage, suffix)
        assert kernel.stats.cache_misses, (damage, suffix)  # (compiled again)
        assert fresh()(np.arange(3.0))[1] == 2.0  # (saved again: loads)
print(len(warnings))
"""


def test_a_damaged_cache_entry_is_dropped_and_compiled_again(tmp_path: Path) -> None:
    """Truncated, emptied and garbled index and data files: each is a miss with one
    warning, the kernel compiles and is saved again (each raised an unpickling error in
    every later call of every process before)."""
    (tmp_path / "kernel_module.py").write_text(KERNEL_MODULE)
    cache = tmp_path / "cache"
    environment = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        _machinery.CACHE_VARIABLE: str(cache),
    }  # fmt: skip
    environment.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", HEAL, str(cache)], capture_output=True, text=True,
        env=environment, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split()[-1] == "6"  # (one warning per damaged file)
