"""The background compile's process: ``python -m linattn.cli._warm_job STEM``.

Started by :mod:`linattn._warm` (detached, with ``LINATTN_COMPILE=foreground``): reads
the job ``STEM.job`` (shapes, dtype, map, options and state of a call), runs a call of
that kind on zeros with ``backend="numba"``, which compiles its kernels into the compile
cache under the cache's lock, then marks ``STEM.ready`` (or ``STEM.failed``, with the
error) and removes ``STEM.pending`` and the job.  Markers are written under a temporary
name and renamed: a reader sees a whole marker or none.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main", "run_job"]


def run_job(job: dict[str, Any]) -> None:
    """Run one call of the job's kind on zeros, on the kernels (compiling them)."""
    import numpy as np

    import linattn as la

    dtype = np.dtype(job["dtype"])
    q, k, v = (np.zeros(job["shapes"][name], dtype) for name in ("q", "k", "v"))
    options = dict(job["options"])
    for name in ("key_mask", "exact_key_mask"):
        if job[name] is not None:
            options[name] = np.ones(job[name], bool)
    la.linear_attention(q, k, v, job["feature_map"], backend="numba", **options)


def _mark(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def main(argv: list[str] | None = None) -> int:
    """Run the job at ``argv[0]`` (a stem); 0 when its kernels are compiled."""
    stem = Path((argv if argv is not None else sys.argv[1:])[0])
    start = time.perf_counter()
    try:
        with open(stem.with_suffix(".job"), "rb") as f:
            job = pickle.load(f)
        run_job(job)
    except Exception:  # (any failure: calls of this kind then compile in the call)
        _mark(stem.with_suffix(".failed"), traceback.format_exc())
        code = 1
    else:
        _mark(stem.with_suffix(".ready"), f"compiled in {time.perf_counter() - start:.1f} s\n")
        code = 0
    for suffix in (".pending", ".job"):
        with contextlib.suppress(OSError):
            stem.with_suffix(suffix).unlink()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
