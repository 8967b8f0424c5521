"""Sequence-parallel causal attention on long sequences over a local two-worker cluster.

For each length ``L`` (fixed tokens per sequence chunk) this measures the wall time
of ``linattn.distributed.sequence_parallel_attention(..., causal=True)`` and the
peak resident memory of every worker process (the kernel's high-water mark
``VmHWM``, reset before each run through ``/proc/self/clear_refs``), and compares
the first ``--prefix`` outputs with an in-memory ``linattn.linear_attention`` run.
Peak memory that stays flat as ``L`` grows is the point: no worker holds the
sequence.

Inputs are standard normal, generated chunk by chunk on the workers (so no process
ever holds a whole input); the run computes the output's prefix and its sum of
squares in one pass, so every output chunk is computed and none is gathered whole.
Wall time includes generating the inputs.  Not a pytest file: a script, run as

    python benchmarks/distributed_long.py                     # L = 2^16, 2^18, 2^20
    python benchmarks/distributed_long.py --lengths 16384 32768 --chunk 4096
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import linattn as la
from linattn.distributed import sequence_parallel_attention


def _reset_peak() -> int:
    """Reset this process's peak RSS; return its current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _peak() -> int:
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _inputs(da, length, args, dtype):  # type: ignore[no-untyped-def]
    shape = (1, args.heads, length, args.head_dim)
    chunks = (1, args.heads, args.chunk, args.head_dim)
    return [
        da.random.default_rng(seed).standard_normal(shape, chunks=chunks, dtype=dtype)
        for seed in (1, 2, 3)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**16, 2**18, 2**20])
    parser.add_argument("--chunk", type=int, default=8192, help="tokens per sequence chunk")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--prefix", type=int, default=16384, help="tokens checked in memory")
    parser.add_argument("--chunk-size", type=int, default=64, help="linear_attention chunk_size")
    parser.add_argument("--backend", default=None, help="auto, numba or array_api")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="6GiB")
    args = parser.parse_args()

    import dask.array as da
    import distributed

    dtype = np.dtype(args.dtype)
    fm = la.FeatureMap(args.head_dim, args.features, seed=0)
    print(
        f"B=1 H={args.heads} d={args.head_dim} m={args.features} {args.dtype}, "
        f"{args.chunk} tokens per sequence chunk, chunk_size={args.chunk_size}, "
        f"backend={args.backend or os.environ.get('LINATTN_BACKEND', 'auto')}, "
        f"{args.workers} worker processes x 1 thread, {os.cpu_count()} CPUs"
    )
    with (
        distributed.LocalCluster(
            n_workers=args.workers,
            threads_per_worker=1,
            processes=True,
            memory_limit=args.memory_limit,
            dashboard_address=None,
            env={"NUMBA_NUM_THREADS": "1"},
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        print(
            f"{'L':>9} {'chunks':>6} {'wall s':>8} {'peak RSS per worker (MiB)':>28} "
            f"{'idle RSS':>9} {'max|diff| prefix':>17} {'load avg':>15}"
        )
        for length in args.lengths:
            q, k, v = _inputs(da, length, args, dtype)
            out = sequence_parallel_attention(
                q, k, v, fm, causal=True, chunk_size=args.chunk_size, backend=args.backend
            )
            prefix = min(args.prefix, length)
            client.restart()  # fresh worker processes: nothing left over from the last run
            idle = client.run(_reset_peak)
            load_before = os.getloadavg()[0]
            start = time.perf_counter()
            head, total = client.compute([out[..., :prefix, :], (out * out).sum()], sync=True)
            wall = time.perf_counter() - start
            peaks = client.run(_peak)
            load_after = os.getloadavg()[0]
            assert np.isfinite(total)
            qp, kp, vp = (x[..., :prefix, :].compute(scheduler="sync") for x in (q, k, v))
            expected = la.linear_attention(
                qp, kp, vp, fm, causal=True, chunk_size=args.chunk_size, backend=args.backend
            )
            diff = float(np.abs(head - expected).max())
            mib = " ".join(f"{peaks[w] / 2**20:8.0f}" for w in sorted(peaks))
            rest = " ".join(f"{idle[w] / 2**20:4.0f}" for w in sorted(idle))
            print(
                f"{length:>9} {len(out.chunks[2]):>6} {wall:>8.1f} {mib:>28} {rest:>9} "
                f"{diff:>17.2e} {load_before:>6.1f}->{load_after:<6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
