"""The first call on an empty compile cache: the README's examples and ``linattn demo``,
each in a fresh process over an empty cache, wall time, and the kernels each compiled.

For every checkout given (``PYTHONPATH``) and mode (``LINATTN_COMPILE``: ``foreground``
compiles in the call; ``background``, the default since the background compile, runs
the portable path while a detached job compiles), each scenario runs in a fresh process
over a fresh cache directory; with ``background`` the script then waits for the jobs and
runs the scenario a second time over the same cache (the second process).  Scenarios run
one after another, never beside a compiling job.  Run from the repository::

    git worktree add /tmp/before <commit>
    python benchmarks/first_call.py --checkout /tmp/before --checkout .

Prints one line per run and, per checkout, the kernels compiled with their seconds (the
``linattn.numba`` log, foreground runs).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NUMPY_EXAMPLE = """
import numpy as np
import linattn as la

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 1024, 64), dtype=np.float32) for _ in range(3))
fm = la.FeatureMap(64, 256, kind="hyperbolic", seed=0)
out = la.linear_attention(q, k, v, fm, causal=True)
exact = la.softmax_attention(q, k, v, causal=True)
_, state = la.linear_attention(
    q[..., :1000, :], k[..., :1000, :], v[..., :1000, :], fm, causal=True, return_state=True
)
step = la.linear_attention(
    q[..., 1000:1001, :], k[..., 1000:1001, :], v[..., 1000:1001, :], fm, causal=True, state=state
)
assert np.allclose(step, out[..., 1000:1001, :], rtol=1e-4, atol=1e-5)
"""

WINDOW_EXAMPLE = """
import numpy as np
import linattn as la

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 4, 2048, 64), dtype=np.float32) for _ in range(3))
fm = la.FeatureMap(64, 256, kind="hyperbolic", seed=0)
out = la.linear_attention(q, k, v, fm, causal=True, window=64, sink_keys=4)
local = la.linear_attention(q, k, v, None, causal=True, window=64, sink_keys=4)
_, state = la.linear_attention(
    q[..., :-1, :], k[..., :-1, :], v[..., :-1, :], fm, causal=True, window=64, sink_keys=4,
    return_state=True,
)
"""

LOGGED = """
import logging, runpy, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
logging.getLogger("linattn.numba").setLevel(logging.DEBUG)
"""

SCENARIOS = {
    "README NumPy example": LOGGED + NUMPY_EXAMPLE,
    "README window + sinks example": LOGGED + WINDOW_EXAMPLE,
    "linattn demo": LOGGED + "from linattn.cli import main\nmain(['demo', '--out', sys.argv[1]])",
}


def run(checkout: Path, code: str, mode: str, cache: Path, out: Path) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "LINATTN_COMPILE": mode}
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("LINATTN_BACKEND", None)
    env["LINATTN_NUMBA_CACHE"] = str(cache)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True,
        cwd=out, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{checkout} {mode}: failed\n{done.stderr[-3000:]}")
    return seconds, done.stderr


def wait_for_jobs(cache: Path, timeout: float = 900) -> float:
    start = time.monotonic()
    while list((cache / "warm").glob("*.pending")) and time.monotonic() - start < timeout:
        time.sleep(0.5)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, action="append", required=True)
    parser.add_argument("--modes", default="foreground,background")
    parser.add_argument("--only", help="run only the scenarios whose name contains this")
    args = parser.parse_args()
    compiled: dict[str, list[str]] = {}
    for checkout in args.checkout:
        for mode in args.modes.split(","):
            for name, code in SCENARIOS.items():
                if args.only and args.only not in name:
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    cache, out = Path(tmp) / "cache", Path(tmp)
                    seconds, log = run(checkout, code, mode, cache, out)
                    line = f"{checkout} {mode:<10} {name:<30} first process {seconds:6.1f} s"
                    if mode == "foreground":
                        kernels = re.findall(r"compiled (\S+) \(([^)]*)\) in ([\d.]+) s", log)
                        compiled.setdefault(str(checkout), []).extend(
                            f"  {name}: {k} ({v}) {s} s" for k, v, s in kernels
                        )
                    if mode == "background":
                        waited = wait_for_jobs(cache)
                        again, _ = run(checkout, code, mode, cache, out)
                        line += f"; jobs done {waited:5.1f} s later; second process {again:5.1f} s"
                    print(line, flush=True)
    for checkout, lines in compiled.items():
        print(f"kernels compiled, {checkout}:", *lines, sep="\n")


if __name__ == "__main__":
    main()
