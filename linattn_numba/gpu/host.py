"""Causal linear attention on the GPU: the host side of the Numba CUDA kernels.

Checks a call, flattens the batch axes, allocates outputs and scratch in the
caller's library (:mod:`linattn_numba.gpu.arrays`), and launches the kernels of
:mod:`linattn_numba.gpu.kernels` (same algorithm, stabilisers and results as
``linattn.causal.causal``).

* Arrays reach the kernels zero-copy through ``__cuda_array_interface__``; only
  non-contiguous or broadcast inputs are copied (to C order, by their library).
* Kernels run on the caller's current stream: CuPy's current stream,
  ``torch.cuda.current_stream()`` for torch (which does not report its stream).
* Results are the caller's array type on the same device; state and
  accumulation are float32 (float64 inputs compute in float64; float16 and
  bfloat16 inputs are upcast to float32 first).
* Everything is validated before any launch; a failed launch raises
  ``RuntimeError`` naming the kernel (asynchronous faults surface at the
  caller's next synchronisation, as for any CUDA library).
* torch CUDA tensors go through the custom operators of :mod:`linattn_numba.torch_ops`
  (``torch.ops.linattn.causal_forward`` / ``causal_backward``: autograd,
  ``torch.compile``), whose CUDA implementations are :func:`forward` and
  :func:`backward`.
* Scratch memory: the state before every chunk, ``(B, L / C, m, d_v + 1)`` in
  the compute dtype (two such arrays in backward), about the size of one
  log-feature array at ``C = 64``; it is what makes every step but an
  elementwise scan parallel over chunks.

Examples
--------
The ``"numpy"`` library copies host arrays to the device and back (under the
CUDA simulator, ``NUMBA_ENABLE_CUDASIM=1``, this needs no GPU):

>>> import numpy as np
>>> from linattn_numba import gpu
>>> lq = np.zeros((1, 3, 2)); va = np.ones((1, 3, 2))
>>> kv, mu = np.zeros((1, 2, 2)), np.full((1, 2), -np.inf)
>>> out, kv_out, mu_out = gpu.forward("numpy", lq, lq, va, kv, mu, 2)  # doctest: +SKIP
>>> out[0, :, -1]  # doctest: +SKIP
array([1., 2., 3.])
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from linattn_numba import _contract
from linattn_numba.gpu import blas, target
from linattn_numba.gpu.arrays import LIBRARIES, Library
from linattn_numba.gpu.kernels import KEY_STATE, QUERY, TILE, WEIGHTED_QUERY, kernels

__all__ = [
    "DESIGNS",
    "DESIGN_VARIABLE",
    "TF32_VARIABLE",
    "backward",
    "design",
    "forward",
]

MAX_BATCH = 65535  # CUDA's limit on gridDim.y
BLOCK = (TILE, TILE)
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")  # (computed in float32 or 64)

DESIGNS = ("kernels", "blas")
"""Forward designs: numba-cuda kernels throughout (the default), or the chunk products
through the vendor BLAS (:mod:`linattn_numba.gpu.blas`)."""
DESIGN_VARIABLE = "LINATTN_CUDA_DESIGN"
TF32_VARIABLE = "LINATTN_CUDA_TF32"


def design(choice: str | None = None) -> tuple[str, bool]:
    """The forward design and whether its float32 products may use TF32.

    ``choice`` (``"kernels"`` or ``"blas"``), else the environment variable
    ``LINATTN_CUDA_DESIGN``, else ``"kernels"``: no GPU measurement has yet shown
    the BLAS design faster, so the kernels stay the default.  TF32 is off unless
    ``LINATTN_CUDA_TF32=1`` (it breaks the float32 tolerance of 1e-5).

    Examples
    --------
    >>> from linattn_numba import gpu
    >>> gpu.design("blas")[0]
    'blas'
    """
    name = os.environ.get(DESIGN_VARIABLE, "kernels") if choice is None else choice
    if name not in DESIGNS:
        source = "design" if choice is not None else f"the environment variable {DESIGN_VARIABLE}"
        raise ValueError(f"{source} must be one of {DESIGNS}; got {name!r}")
    flag = os.environ.get(TF32_VARIABLE, "0")
    if flag not in ("0", "1"):
        raise ValueError(f"the environment variable {TF32_VARIABLE} must be 0 or 1; got {flag!r}")
    return name, flag == "1"


# --------------------------------------------------------------------------------------
# Validation (before any launch) and launching.


@dataclass(frozen=True)
class _Problem(_contract.Sizes):
    """One checked call: the contract's sizes, and the library, compute dtype, device."""

    lib: Library
    dtype: str
    device: int

    @property
    def num_chunks(self) -> int:
        return -(-self.length // self.chunk)

    @property
    def tiles(self) -> int:
        """Query (or key) tiles per chunk."""
        return -(-min(self.chunk, self.length) // TILE)

    @property
    def row_tiles(self) -> int:
        """State tiles along ``m``."""
        return -(-self.m // TILE)

    @property
    def column_tiles(self) -> int:
        """State tiles along ``d_v + 1``."""
        return -(-self.width // TILE)

    def prepare(self, x: Any, role: str) -> Any:
        """``x`` flattened, in the compute dtype, C-contiguous (a copy only if needed)."""
        return self.lib.prepare(x, self.flat(role), self.dtype)

    def empty(self, shape: str | tuple[int, ...]) -> Any:
        """An uninitialised array on the call's device: a role's flat shape, or ``shape``."""
        return self.lib.empty(self.flat(shape) if isinstance(shape, str) else shape,
                              self.dtype, self.device)  # fmt: skip

    def result(self, x: Any, role: str) -> Any:
        """``x`` in the caller's library with the caller's batch axes."""
        return self.lib.result(x, self.shape(role))


def _check(lib: Library, named: dict[str, Any], chunk_size: object) -> _Problem:
    """Validate a kernel call (:mod:`linattn_numba._contract`, then devices and batch)."""
    _contract.check_arrays(named, lib.is_array, f"a {lib.name} array for the CUDA kernel")
    precision = _contract.check_dtypes(named, FLOAT_NAMES, same=False)
    devices = {name: lib.device_id(x) for name, x in named.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev is None:
            raise ValueError(f"{name} must be on a CUDA device; got {named[name].device}")
        if dev != first:
            raise ValueError(
                f"all arrays must be on one CUDA device; {first_name} is on device {first} "
                f"but {name} is on device {dev}"
            )
    sizes = _contract.check_shapes(named, chunk_size)
    if sizes.batch > MAX_BATCH:
        raise ValueError(
            f"the CUDA kernel serves at most {MAX_BATCH} batch entries (product of the "
            f"leading axes); got {sizes.batch}"
        )
    dtype = "float64" if precision == "float64" else "float32"
    return _Problem(**vars(sizes), lib=lib, dtype=dtype, device=first or 0)


class _Launcher:
    """Launches kernels of one precision on one stream; launch failures raise RuntimeError."""

    def __init__(self, problem: _Problem) -> None:
        self.kernels = kernels(problem.dtype)
        self.stream = problem.lib.stream(problem.device)
        self.library_view = problem.lib.view
        self.views: dict[int, tuple[Any, Any]] = {}

    def view(self, x: Any) -> Any:
        """numba's view of ``x``, made once per array (the arrays outlive the launcher)."""
        if id(x) not in self.views:
            self.views[id(x)] = (x, self.library_view(x))
        return self.views[id(x)][1]

    def __call__(
        self, name: str, grid: tuple[int, ...], block: tuple[int, ...], *args: Any
    ) -> None:
        if 0 in grid:
            return
        args = tuple(a if isinstance(a, int | bool) else self.view(a) for a in args)
        try:
            with warnings.catch_warnings():
                # Small problems under-fill a GPU; that is the caller's choice, not an error.
                for category in target.PERFORMANCE_WARNINGS:
                    warnings.simplefilter("ignore", category)
                getattr(self.kernels, name)[grid, block, self.stream](*args)
        except Exception as error:  # CudaAPIError, CudaSupportError, ...
            raise RuntimeError(
                f"CUDA kernel {name} failed to launch (grid {grid}, block {block}): {error}"
            ) from error


def _scan(p: _Problem, lq: Any, lk: Any, kv: Any, log_shift: Any) -> tuple[Any, ...]:
    """What forward and backward both start with: ``launch``, the input state ``S``,
    empty ``kv_out`` and ``mu_out`` (written by the kernels), and the stabilisers
    ``mus, F, G, Gm, flo`` of every chunk (see ``_gpu_kernels``)."""
    launch = _Launcher(p)
    state, mu = p.prepare(kv, "state"), p.prepare(log_shift, "shift")
    kv_out, mu_out = p.empty("state"), p.empty("shift")
    mus = p.empty((p.batch, p.num_chunks + 1, p.m))
    F, G, Gm = (p.empty((p.batch, p.length)) for _ in range(3))
    flo = p.empty((p.batch, p.num_chunks))
    per_block = TILE * TILE
    feature_blocks = -(-p.m // per_block)
    grid = (p.num_chunks, feature_blocks, p.batch)
    launch("chunk_max", grid, (per_block,), lk, mus, p.chunk)
    launch("prefix_max", (feature_blocks, p.batch), (per_block,), mu, mus, mu_out)
    launch("row_stats", (p.num_chunks, p.batch), BLOCK, lq, lk, mus, F, G, Gm, flo, p.chunk)
    return launch, state, kv_out, mu_out, (mus, F, G, Gm, flo)


def forward(
    library: str,
    log_phi_q: Any,
    log_phi_k: Any,
    values_aug: Any,
    kv: Any,
    log_shift: Any,
    chunk_size: int,
    design_name: str | None = None,
    allow_tf32: bool | None = None,
    *,
    return_log_scale: bool = False,
) -> tuple[Any, ...]:
    """Chunked causal attention: ``(outputs_aug, kv_out, log_shift_out)`` in ``library``'s type.

    Same contract and results as ``linattn.causal.causal`` (see ``linattn_numba``).
    ``design_name`` and ``allow_tf32`` override ``design()`` (for tests and timing).
    With ``return_log_scale``, also ``log_scale (*batch, L)``, the stabilisers taken out
    of each row: true ``[num | den] = exp(log_scale) * outputs_aug`` (as on the CPU,
    ``linattn_numba.cpu.numpy_forward``; the same value up to rounding).
    """
    inputs = (log_phi_q, log_phi_k, values_aug, kv, log_shift)
    p = _check(LIBRARIES[library], _contract.named(inputs), chunk_size)
    name, env_tf32 = design(design_name)
    tf32 = env_tf32 if allow_tf32 is None else allow_tf32
    with target.gpu(p.device):
        lq, lk = p.prepare(log_phi_q, "features"), p.prepare(log_phi_k, "features")
        va = p.prepare(values_aug, "values")
        out = p.empty("values")
        scale = p.empty((p.batch, p.length)) if return_log_scale else None
        if p.batch and p.length:
            launch, state, kv_out, mu_out, stats = _scan(p, lq, lk, kv, log_shift)
            arrays = (lq, lk, va, state, out, kv_out)
            if name == "blas":
                blas.forward(p, launch, arrays, stats, tf32)
            else:
                _forward_kernels(p, launch, arrays, stats)
            if scale is not None:
                grid = (-(-p.length // (TILE * TILE)), p.batch)
                launch("log_scale", grid, (TILE * TILE,), stats[1], stats[3], scale)
        else:
            kv_out = p.lib.copy(kv, p.flat("state"), p.dtype)
            mu_out = p.lib.copy(log_shift, p.flat("shift"), p.dtype)
        results = p.result(out, "values"), p.result(kv_out, "state"), p.result(mu_out, "shift")
        if scale is None:
            return results
        return (*results, p.lib.result(scale, (*p.batch_shape, p.length)))


def _forward_kernels(
    p: _Problem, launch: _Launcher, arrays: tuple[Any, ...], stats: tuple[Any, ...]
) -> None:
    """The forward in numba-cuda kernels throughout (the default design)."""
    lq, lk, va, state, out, kv_out = arrays
    # The state before every chunk, (B, L / C, m, d_v + 1): about as large as one
    # log-feature array, and it turns the scan over chunks into parallel work.
    states = p.empty((p.batch, p.num_chunks, p.m, p.width))
    grid: tuple[int, ...] = (p.num_chunks * p.tiles, p.batch)
    launch("forward_intra", grid, BLOCK, lq, lk, va, *stats, out, p.chunk, p.tiles)
    grid = (p.num_chunks, p.row_tiles * p.column_tiles, p.batch)
    launch(
        "chunk_increments", grid, BLOCK, lq, lk, va, *stats, states, p.chunk,
        p.row_tiles, KEY_STATE,
    )  # fmt: skip
    grid = (-(-p.m * p.width // (TILE * TILE)), p.batch)
    launch("scan_states", grid, (TILE * TILE,), state, stats[0], states, kv_out, False)
    grid = (p.num_chunks * p.tiles, p.column_tiles, p.batch)
    launch("state_readout", grid, BLOCK, lq, lk, *stats, states, out, p.chunk, p.tiles, QUERY)


def backward(
    library: str,
    log_phi_q: Any,
    log_phi_k: Any,
    values_aug: Any,
    kv: Any,
    log_shift: Any,
    chunk_size: int,
    d_outputs_aug: Any,
    d_kv_out: Any | None,
) -> tuple[Any, Any, Any, Any]:
    """Vector-Jacobian product of :func:`forward` with the stabilisers held constant.

    Returns ``(d_log_phi_q, d_log_phi_k, d_values_aug, d_kv)``; ``d_kv_out=None``
    means zero.  Holding the stabilisers constant is exact for the normalised
    output, whose numerator and denominator share every shift.  Chunk states are
    recomputed forward from ``kv``, never by subtraction.
    """
    inputs = (log_phi_q, log_phi_k, values_aug, kv, log_shift, d_outputs_aug, d_kv_out)
    named = _contract.named(inputs, ("d_outputs_aug", "d_kv_out"))
    if d_kv_out is None:
        del named["d_kv_out"]
    p = _check(LIBRARIES[library], named, chunk_size)
    with target.gpu(p.device):
        lq, lk = p.prepare(log_phi_q, "features"), p.prepare(log_phi_k, "features")
        va, d_out = p.prepare(values_aug, "values"), p.prepare(d_outputs_aug, "values")
        d_lq, d_lk, d_va = p.empty("features"), p.empty("features"), p.empty("values")
        if d_kv_out is None:
            d_final = p.lib.zeros(p.flat("state"), p.dtype, p.device)
        else:
            d_final = p.prepare(d_kv_out, "state")
        if p.batch and p.length:
            launch, state, kv_out, _, stats = _scan(p, lq, lk, kv, log_shift)
            d_kv = p.empty("state")
            # S_n (recomputed forward from kv) and dS_{n+1} (a reverse scan) for every chunk.
            shape = (p.batch, p.num_chunks, p.m, p.width)
            states, d_states = p.empty(shape), p.empty(shape)
            row_tiles = p.row_tiles
            grid: tuple[int, ...] = (p.num_chunks * p.tiles, p.batch)
            launch(
                "backward_intra_queries", grid, BLOCK, lq, lk, va, d_out, *stats, d_lq,
                p.chunk, p.tiles,
            )  # fmt: skip
            launch(
                "backward_intra_keys", grid, BLOCK, lq, lk, va, d_out, *stats, d_lk, d_va,
                p.chunk, p.tiles,
            )  # fmt: skip
            grid = (p.num_chunks, row_tiles * p.column_tiles, p.batch)
            launch(
                "chunk_increments", grid, BLOCK, lq, lk, va, *stats, states, p.chunk, row_tiles,
                KEY_STATE,
            )  # fmt: skip
            launch(
                "chunk_increments", grid, BLOCK, lq, lk, d_out, *stats, d_states, p.chunk,
                row_tiles, WEIGHTED_QUERY,
            )  # fmt: skip
            grid = (-(-p.m * p.width // (TILE * TILE)), p.batch)
            launch("scan_states", grid, (TILE * TILE,), state, stats[0], states, kv_out, False)
            launch("scan_states", grid, (TILE * TILE,), d_final, stats[0], d_states, d_kv, True)
            grid = (p.num_chunks * p.tiles, row_tiles, p.batch)
            launch(
                "feature_readout", grid, BLOCK, lq, lk, d_out, *stats, states, d_lq, p.chunk,
                p.tiles, WEIGHTED_QUERY,
            )  # fmt: skip
            launch(
                "feature_readout", grid, BLOCK, lq, lk, va, *stats, d_states, d_lk, p.chunk,
                p.tiles, KEY_STATE,
            )  # fmt: skip
            grid = (p.num_chunks * p.tiles, p.column_tiles, p.batch)
            launch(
                "state_readout", grid, BLOCK, lq, lk, *stats, d_states, d_va, p.chunk, p.tiles,
                KEY_STATE,
            )  # fmt: skip
        else:
            d_kv = p.lib.copy(d_final, p.flat("state"), p.dtype)
        return (
            p.result(d_lq, "features"),
            p.result(d_lk, "features"),
            p.result(d_va, "values"),
            p.result(d_kv, "state"),
        )
