"""ktlong: chat with a local LLM about very long documents, with block-sparse CPU attention."""

import os as _os

# Before torch or numba load their OpenMP runtimes: idle threads sleep instead of spinning, or
# torch's threads take the cores from the attention kernels after every op (DESIGN.md facts).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
