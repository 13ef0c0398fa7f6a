"""Thread count for the kernels (Numba) and for torch.

Numba's thread count and loop schedule are per calling thread, so every kernel wrapper calls
`use_threads()`: a kernel launched from a helper thread (e.g. while the GPU runs the local window)
honours the same setting. Parallel loops hand out one item at a time (dynamic schedule): on a busy
machine a thread that loses its core holds back no one. Each parallel kernel has exactly one prange
loop and allocates through serial helpers, so no implicit parfor (an np.zeros fill, say) runs
element by element under that schedule.
"""
from __future__ import annotations

import os
import threading
import time

import numba

_threads = 0  # 0 = all cores
_applied = threading.local()  # .n: the count this thread last gave Numba through use_threads


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


def usable_cores() -> int:
    """CPUs this process may run on (affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_prev: tuple[int, int, float] | None = None  # the last snapshot: idle, total ticks; own seconds
_last = -1.0  # the last result


def _snapshot() -> tuple[int, int, float]:
    """(idle, total) clock ticks of all CPUs since boot (/proc/stat), and this process's CPU
    seconds (all its threads)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait ...
    t = os.times()
    return v[3] + v[4], sum(v), t.user + t.system


def idle_cores(interval: float = 0.1) -> float:
    """CPUs not used by other processes since the last call (this process's own work counts as
    free: it is ours to share out). A call less than ~50 ms after the last one returns the last
    result; the first call samples over `interval` seconds. Any other work counts as busy, niced
    work included: under autogroup scheduling a niced job in another session still takes its
    share of a core. All usable cores where /proc/stat is missing."""
    global _prev, _last
    cores = usable_cores()
    try:
        cur = _snapshot()
        base = _prev
        if base is not None and cur[1] - base[1] < 0.05 * _CLK_TCK * (os.cpu_count() or 1):
            return _last  # too soon to tell anything new (e.g. an answer right after its prompt)
        if base is None:
            time.sleep(interval)
            base, cur = cur, _snapshot()
    except (OSError, ValueError):
        return float(cores)
    total = cur[1] - base[1]
    if total <= 0:
        return float(cores)
    _prev = cur
    free = cur[0] - base[0] + (cur[2] - base[2]) * _CLK_TCK
    _last = max(0.0, min(float(cores), (os.cpu_count() or cores) * free / total))
    return _last


def physical_cores() -> int:
    """Physical cores this process may run on: psutil's count (hyperthreads not counted), no
    more than the usable CPUs; at least 1."""
    import psutil

    return max(1, min(psutil.cpu_count(logical=False) or usable_cores(), usable_cores()))


def auto_threads() -> int:
    """Threads for `threads_num: 0`: the idle cores, rounded, but never fewer than the physical
    cores less one (at least 1). A parallel region is as slow as its slowest thread, so a thread
    on a core another job holds costs far more than it brings (a 2-core machine with one busy
    core decodes ~4x slower on 2 threads than on 1); the floor keeps a short burst of other work
    at the moment of measuring from leaving most of a bigger machine idle. An explicit
    `threads_num` bypasses all of this."""
    floor = max(1, physical_cores() - 1)
    return max(floor, min(usable_cores(), int(idle_cores() + 0.5)))


def split_threads() -> int:
    """The thread count that sizes a kernel's work split where the split decides float rounding
    (attention parts merged by log-sum-exp, vote parts): the machine's, not the session's, so an
    answer does not change with `-t` or with how busy the cores were when the chat began."""
    return numba.config.NUMBA_NUM_THREADS


def use_threads() -> int:
    """Apply the configured thread count to the calling thread; returns it. Numba is asked only
    when the count changed: its two getters cost ~30 us a decode step after a cache flush."""
    n = _threads or numba.config.NUMBA_NUM_THREADS
    if getattr(_applied, "n", 0) != n:
        numba.set_num_threads(n)
        numba.set_parallel_chunksize(1)
        _applied.n = n
    return n
