"""How the fit computes: each calibration batch in :data:`PIECES` pieces of rows, on as
many threads where the arrays are NumPy's, and BLAS on one thread.

The pieces' results are summed in order
(:func:`~linattn.transfer.loss.batch_loss_grad`), so that the fit on threads is the
fit on one thread to the last bit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from linattn._xp import Namespace, is_numpy_namespace

__all__ = ["PIECES", "Run", "cores", "one_blas_thread", "pieces_run"]

#: Each calibration batch is split along its rows into this many pieces, which the fit
#: computes on as many threads where the arrays are NumPy's (its products and
#: elementwise work release the GIL; BLAS itself keeps one thread during the fit).
#: Fixed, not the machine's core count: a seed gives the same fit, to the last bit, on
#: any machine.
PIECES = 2


#: How the fit maps a function over pieces of batches: ``map``, or a thread pool's.
Run = Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]]


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        return os.cpu_count() or 1


@contextlib.contextmanager
def pieces_run(xp: Namespace) -> Iterator[Run]:
    """A thread pool's ``map`` for NumPy arrays on a machine with more than one core;
    ``map`` otherwise (other libraries keep their own threads)."""
    workers = min(PIECES, cores()) if is_numpy_namespace(xp) else 1
    if workers < 2:
        yield map
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="linattn-fit") as pool:
        yield pool.map


def one_blas_thread() -> Any:
    """One BLAS thread: the fit's many small ``L x L`` products only contend with more
    (measured: 12-20x faster than OpenBLAS on 2 threads for ``(8, 12, 256, 64)`` stacks)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")
