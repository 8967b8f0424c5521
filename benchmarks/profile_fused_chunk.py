"""Where a fused causal chunk spends its time: one head, one thread, stage by stage.

Runs the fused pass's steps cumulatively (features, then the stabilising shifts, the
intra-chunk product, the state readout, the absorption of the keys) and prints the
best-of-N time each stage adds per 64-token chunk.  Workload d=64, m=256, float32.

    python benchmarks/profile_fused_chunk.py [--length 4096] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from numba import njit

import linattn as la
from linattn_numba import _machinery
from linattn_numba.cpu import chunks, features, scalars

STAGES = ("base", "features", "shifts", "intra", "readout", "absorb")


@njit(nogil=True, fastmath={"contract"}, error_model="numpy")
def run(q, k, v, projection, consts, chunk, span, level):  # type: ignore[no-untyped-def]
    length = q.shape[0]
    dv, m = v.shape[1], projection.shape[0]
    dtype = q.dtype
    kv = np.zeros((m, dv + 1), dtype)
    mu = np.full(m, -np.inf, dtype)
    work, square, vecs, state_out, product = chunks.chunk_workspace(chunk, m, dv + 1, dtype)
    proj = np.empty((0, m), dtype)
    lq, lk = np.empty((span, m), dtype), np.empty((span, m), dtype)
    va, block = np.empty((span, dv + 1), dtype), np.zeros((chunk, dv + 1), dtype)
    out = np.empty((length, dv), dtype)
    for s0 in range(0, length, span):
        n = min(s0 + span, length) - s0
        if level >= 1:
            features.log_features(q[s0 : s0 + n], projection, consts, False, proj, lq[:n])
            features.log_features(k[s0 : s0 + n], projection, consts, False, proj, lk[:n])
        for i in range(n):
            va[i, :dv] = v[s0 + i]
            va[i, dv] = 1
        for t0 in range(0, n, chunk):
            c = min(t0 + chunk, n) - t0
            if level >= 2:
                u, psi, phi = work[0][:c], work[1][:c], work[2][:c]
                weights = square[0][: c * c].reshape(c, c)
                intra = square[1][: c * c].reshape(c, c)
                ms, shift, decay, top = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[6][:m]
                g, run_max, w, fq = vecs[3][:c], vecs[4][:c], vecs[5][:c], vecs[7][:c]
                has_state = scalars.safe_shift(mu, ms)
                lqc, lkc, vac = lq[t0 : t0 + c], lk[t0 : t0 + c], va[t0 : t0 + c]
                chunks.chunk_shifts(lqc, lkc, ms, has_state, u, psi, g, run_max, w, weights, fq)
                if level >= 3:
                    np.dot(u, psi.T, intra)
                    intra *= weights
                if level >= 4:
                    np.dot(u, kv, state_out[:c])
                    np.dot(intra, vac, block[:c])
                    for i in range(c):
                        block[i] += w[i] * state_out[i]
                if level >= 5:
                    chunks.absorb(
                        lkc, vac, kv, mu, ms, phi, top, shift, decay, product, psi, g, True
                    )
            for i in range(c):
                out[s0 + t0 + i] = block[i, :dv] / block[i, dv]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    fm = la.FeatureMap(64, 256, seed=0)
    projection = (np.sqrt(fm.scale) * fm.projection).astype(np.float32)
    consts = np.array([0.5 * fm.scale, 0.5 * np.log(256)], np.float32)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(args.length, 64)).astype(np.float32) for _ in range(3))
    chunk, span = 64, features.FEATURE_BLOCK
    best = dict.fromkeys(range(len(STAGES)), float("inf"))
    with _machinery.single_threaded_blas():
        for level in best:  # compile
            run(q[:span], k[:span], v[:span], projection, consts, chunk, span, level)
        for _ in range(args.repeat):
            for level in best:
                start = time.perf_counter()
                run(q, k, v, projection, consts, chunk, span, level)
                seconds = time.perf_counter() - start
                best[level] = min(best[level], seconds * 1e6 / (args.length // chunk))
    for level, name in enumerate(STAGES):
        added = best[level] - (best[level - 1] if level else 0.0)
        print(f"{name:<9} {added:7.1f} us per chunk")
    print(f"{'total':<9} {best[len(STAGES) - 1]:7.1f} us per chunk")


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
