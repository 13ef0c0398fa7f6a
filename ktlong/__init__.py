"""ktlong: chat with a local LLM about very long documents, with block-sparse CPU attention."""

import os as _os

# Before torch or numba load their OpenMP runtimes (they often share torch's): idle threads
# sleep instead of spinning, or torch's threads take the cores from the attention kernels after
# every op (DESIGN.md facts); but first they spin ~0.3 ms, the gaps between a decode step's
# parallel regions, where waking a sleeping thread would cost ~45 us each (ktlong/kernels).
SPIN_COUNT = "30000"  # libgomp's spins before a thread sleeps (~0.3 ms by its own estimate)
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

__version__ = "0.1.0"
