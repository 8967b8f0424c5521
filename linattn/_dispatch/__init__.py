"""The kernels' bridge: the only package that reaches ``linattn_numba``, one module per
compiled path, each pairing its forward with its backward.

- :mod:`~linattn._dispatch.common`: the backends (:func:`resolve_backend`), whether
  numba is installed and the kernels import (:func:`numpy_kernels_why_not`), which
  library an array belongs to, the fused maps' operands;
- :mod:`~linattn._dispatch.scan`: the causal scan's path (:class:`Plan`,
  :func:`scan_plan`, chunk sizes) and the scan on it, with the compiled kernels'
  backward;
- :mod:`~linattn._dispatch.causal_fused`: the fused causal passes, forward and backward;
- :mod:`~linattn._dispatch.bidirectional`: the fused bidirectional passes, forward and
  backward, and exact keys merged in them;
- :mod:`~linattn._dispatch.hybrid`: the window part and the one-pass hybrid kernels;
- :mod:`~linattn._dispatch.decode`: the decoding step.

Which executor runs a call is the executors' and :mod:`linattn._plan`'s decision; every
kernel choice here takes the call's resolved backend (:attr:`Plan.backend`), never the
environment alone.  ``linattn_numba`` is imported lazily, inside these modules' functions,
so ``linattn`` imports without numba.  The names below are the package's interface.
"""

from __future__ import annotations

from linattn._dispatch.bidirectional import (
    fused_bidirectional,
    fused_bidirectional_vjp,
    fused_global,
)
from linattn._dispatch.causal_fused import (
    fused_causal,
    fused_causal_backward,
    fused_causal_rows_vjp,
    fused_causal_vjp,
)
from linattn._dispatch.common import (
    BACKENDS,
    ENVIRONMENT_VARIABLE,
    NUMBA_INSTALLED,
    Backend,
    broadcast_batch,
    cache_directory,
    empty_shift,
    fitted_kernel_arrays,
    fused_map,
    fused_map_arrays,
    installed,
    kernel_sources,
    library_of,
    numpy_kernels_why_not,
    resolve_backend,
    single_threaded_blas,
    torch_projection,
    zeros_state,
)
from linattn._dispatch.decode import (
    decode_kernel,
    fitted_decode_operands,
)
from linattn._dispatch.hybrid import (
    hybrid_kernel_for,
    window_kernel_for,
)
from linattn._dispatch.scan import (
    CPU_FORWARD_CHUNK_SIZE,
    DEFAULT_CHUNK_SIZE,
    EAGER_CPU_TOKENS_PER_PASS,
    PATHS,
    CausalResult,
    Operands,
    Path,
    Plan,
    attend,
    backward_follows,
    causal_plan,
    chunk_size_for,
    fused_pass,
    kernel_for,
    kernel_status,
    numpy_backward,
    portable_plan,
    scan_plan,
    tokens_per_pass,
)

__all__ = [
    "BACKENDS",
    "CPU_FORWARD_CHUNK_SIZE",
    "DEFAULT_CHUNK_SIZE",
    "EAGER_CPU_TOKENS_PER_PASS",
    "ENVIRONMENT_VARIABLE",
    "NUMBA_INSTALLED",
    "PATHS",
    "Backend",
    "CausalResult",
    "Operands",
    "Path",
    "Plan",
    "attend",
    "backward_follows",
    "broadcast_batch",
    "cache_directory",
    "causal_plan",
    "chunk_size_for",
    "decode_kernel",
    "empty_shift",
    "fitted_decode_operands",
    "fitted_kernel_arrays",
    "fused_bidirectional",
    "fused_bidirectional_vjp",
    "fused_causal",
    "fused_causal_backward",
    "fused_causal_rows_vjp",
    "fused_causal_vjp",
    "fused_global",
    "fused_map",
    "fused_map_arrays",
    "fused_pass",
    "hybrid_kernel_for",
    "installed",
    "kernel_for",
    "kernel_sources",
    "kernel_status",
    "library_of",
    "numpy_backward",
    "numpy_kernels_why_not",
    "portable_plan",
    "resolve_backend",
    "scan_plan",
    "single_threaded_blas",
    "tokens_per_pass",
    "torch_projection",
    "window_kernel_for",
    "zeros_state",
]
