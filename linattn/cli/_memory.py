"""Keep freed memory in the process: the conversion's allocator setting.

A conversion at length (``linattn convert --max-length 2048``) allocates and frees
arrays of hundreds of megabytes at every step.  glibc returns each to the kernel
(``mmap``/``munmap``, a per-thread arena's heap trimmed), and the kernel zeroes every
page of the next one on first touch: 2 MB at a time where NumPy asks for huge pages.
Measured on this project's 2-core machine (``docs/command-line.md``), that zeroing was
half the conversion's CPU time.  :func:`keep_freed_memory` tells glibc to serve large
blocks from one heap and keep what is freed (``mallopt``: no ``mmap`` blocks, one arena,
no trimming), so later steps reuse pages already mapped; the process's peak memory is
unchanged (it is the largest step's), but it is not given back until the process ends.

Only the command line calls it (its process is its own); a library never changes its
caller's allocator.  From Python, the same setting is glibc's environment variables,
set before the interpreter starts: ``MALLOC_MMAP_MAX_=0 MALLOC_ARENA_MAX=1
MALLOC_TRIM_THRESHOLD_=2147483647``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; False where the C library is not glibc
    (nothing changed).

    Examples
    --------
    >>> import sys
    >>> keep_freed_memory() == sys.platform.startswith("linux")  # (glibc Linux)
    True
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
