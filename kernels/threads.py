"""Thread count for the kernels (Numba) and for torch.

Numba's thread count and loop schedule are per calling thread, so every kernel wrapper calls
`use_threads()`: a kernel launched from a helper thread (e.g. while the GPU runs the local window)
honours the same setting. Parallel loops hand out one item at a time (dynamic schedule): on a busy
machine a thread that loses its core holds back no one. Each parallel kernel has exactly one prange
loop and allocates through serial helpers, so no implicit parfor (an np.zeros fill, say) runs
element by element under that schedule.
"""
from __future__ import annotations

import numba

_threads = 0  # 0 = all cores


def configure_threads(n: int) -> int:
    """Use `n` threads in kernels and torch (0 = all cores). Returns the count in effect."""
    global _threads
    cores = numba.config.NUMBA_NUM_THREADS
    _threads = cores if n <= 0 else min(n, cores)
    numba.set_num_threads(_threads)
    try:
        import torch
    except ImportError:
        return _threads
    torch.set_num_threads(_threads)
    return _threads


def use_threads() -> int:
    """Apply the configured thread count to the calling thread; returns it."""
    n = _threads or numba.config.NUMBA_NUM_THREADS
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    if numba.get_parallel_chunksize() != 1:
        numba.set_parallel_chunksize(1)
    return n
