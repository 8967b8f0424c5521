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
    python benchmarks/distributed_long.py --graph docs/_static/distributed_graph.png
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


def _start_sampler(dask_worker) -> None:  # type: ignore[no-untyped-def]
    """Sample RSS and the bytes of data the worker holds every 50 ms, keeping the maximum."""
    import threading

    record = {"rss": 0, "held": 0, "stop": False}

    def sample() -> None:
        while not record["stop"]:
            rss = _status_bytes("VmRSS")
            if rss > record["rss"]:
                held = sum(getattr(x, "nbytes", 0) for x in list(dask_worker.data.values()))
                record.update(rss=rss, held=held)
            time.sleep(0.05)

    dask_worker._linattn_sampler = record
    threading.Thread(target=sample, daemon=True).start()


def _stop_sampler(dask_worker) -> dict[str, int]:  # type: ignore[no-untyped-def]
    record = dask_worker._linattn_sampler
    record["stop"] = True
    return {"rss": record["rss"], "held": record["held"]}


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


_ROWS = {
    "k, v": "k, v chunk",
    "linattn-chunk-state": "chunk state",
    "linattn-incoming-state": "incoming state",
    "q": "q chunk",
    "linattn-chunk-outputs": "chunk outputs",
    "linattn-outputs-done": "outputs done",
}


def draw_graph(path: str, chunks: int = 6, lookahead: int = 2) -> None:
    """Draw the causal task graph of one sequence in ``chunks`` chunks (no cluster needed)."""
    import dask.array as da
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dask.core import get_dependencies

    fm = la.FeatureMap(4, 8, seed=0)
    q, k, v = (da.zeros((1, 4 * chunks, 4), chunks=(1, 4, 4), name=n) for n in "qkv")
    out = sequence_parallel_attention(q, k, v, fm, causal=True, lookahead=lookahead)
    graph = dict(out.__dask_graph__())

    def node(key):  # type: ignore[no-untyped-def]
        if not isinstance(key, tuple):
            return None
        name = key[0] if key[0] in "qkv" else key[0].rsplit("-", 1)[0]
        name = "k, v" if name in ("k", "v") else name
        return (name, key[2]) if name in _ROWS else None

    edges = set()
    for key in graph:
        target = node(key)
        if target is not None:
            for dep in get_dependencies(graph, key):
                source = node(dep)
                if source is not None:
                    edges.add((source, target))
    rows = {name: -i for i, name in enumerate(_ROWS)}
    fig, ax = plt.subplots(figsize=(1.6 * chunks + 2.5, 5.2))
    for (name_a, j_a), (name_b, j_b) in sorted(edges):
        wait = name_a == "linattn-outputs-done"
        ax.annotate(
            "",
            xy=(j_b, rows[name_b]),
            xytext=(j_a, rows[name_a]),
            arrowprops={
                "arrowstyle": "->",
                "color": "tab:red" if wait else "0.35",
                "linestyle": "--" if wait else "-",
                "shrinkA": 9,
                "shrinkB": 9,
                "connectionstyle": "arc3,rad=0.25" if wait else "arc3",
            },
        )
    nodes = {a for a, _ in edges} | {b for _, b in edges}
    for name, j in nodes:
        ax.plot(j, rows[name], "o", ms=14, color="tab:blue" if "linattn" in name else "0.7")
    ax.set_yticks(list(rows.values()), [_ROWS[n] for n in rows])
    ax.set_xticks(range(chunks), [f"chunk {j}" for j in range(chunks)])
    ax.set_xlim(-0.6, chunks - 0.4)
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    ax.set_title(
        f"Causal sequence-parallel attention: {chunks} chunks, lookahead={lookahead} "
        "(red: chunk state waits for earlier outputs)"
    )
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


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
    parser.add_argument("--lookahead", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="6GiB")
    parser.add_argument("--graph", metavar="PNG", help="only draw the causal task graph")
    args = parser.parse_args()
    if args.graph:
        draw_graph(args.graph)
        return

    import dask.array as da
    import distributed

    dtype = np.dtype(args.dtype)
    fm = la.FeatureMap(args.head_dim, args.features, seed=0)
    print(
        f"B=1 H={args.heads} d={args.head_dim} m={args.features} {args.dtype}, "
        f"{args.chunk} tokens per sequence chunk, lookahead={args.lookahead}, "
        f"chunk_size={args.chunk_size}, "
        f"backend={args.backend or os.environ.get('LINATTN_BACKEND', 'auto')}, "
        f"{args.workers} worker processes x 1 thread, {os.cpu_count()} CPUs"
    )
    with (
        distributed.LocalCluster(
            n_workers=args.workers,
            threads_per_worker=1,
            processes=True,
            memory_limit=args.memory_limit,
            dashboard_address=":0",
            env={"NUMBA_NUM_THREADS": "1"},
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        print(
            f"{'L':>9} {'chunks':>6} {'wall s':>8} {'peak RSS per worker (MiB)':>28} "
            f"{'idle RSS':>9} {'data at peak':>12} {'max|diff| prefix':>17} {'load avg':>15}"
        )
        for length in args.lengths:
            q, k, v = _inputs(da, length, args, dtype)
            options = {"chunk_size": args.chunk_size, "backend": args.backend}
            out = sequence_parallel_attention(
                q, k, v, fm, causal=True, lookahead=args.lookahead, **options
            )
            prefix = min(args.prefix, length)
            client.restart()  # fresh worker processes: nothing left over from the last run
            warm = [x[..., : args.chunk, :] for x in (q, k, v)]  # compile kernels first
            client.compute(sequence_parallel_attention(*warm, fm, causal=True, **options)).result()
            idle = client.run(_reset_peak)
            client.run(_start_sampler)
            load_before = os.getloadavg()[0]
            start = time.perf_counter()
            head, total = client.compute([out[..., :prefix, :], (out * out).sum()], sync=True)
            wall = time.perf_counter() - start
            peaks = client.run(_peak)
            sampled = client.run(_stop_sampler)
            load_after = os.getloadavg()[0]
            assert np.isfinite(total)
            qp, kp, vp = (x[..., :prefix, :].compute(scheduler="sync") for x in (q, k, v))
            expected = la.linear_attention(
                qp, kp, vp, fm, causal=True, chunk_size=args.chunk_size, backend=args.backend
            )
            diff = float(np.abs(head - expected).max())
            mib = " ".join(f"{peaks[w] / 2**20:8.0f}" for w in sorted(peaks))
            rest = " ".join(f"{idle[w] / 2**20:4.0f}" for w in sorted(idle))
            held = " ".join(f"{sampled[w]['held'] / 2**20:4.0f}" for w in sorted(sampled))
            print(
                f"{length:>9} {len(out.chunks[2]):>6} {wall:>8.1f} {mib:>28} {rest:>9} {held:>12} "
                f"{diff:>17.2e} {load_before:>6.1f}->{load_after:<6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
