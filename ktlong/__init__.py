"""ktlong: chat with a local LLM about very long documents, with block-sparse CPU attention."""

import os as _os

# Before torch or numba load their OpenMP runtimes (they often share torch's): idle threads
# sleep instead of spinning, or torch's threads take the cores from the attention kernels after
# every op (DESIGN.md facts); but first they spin ~0.3 ms, the gaps between a decode step's
# parallel regions, where waking a sleeping thread would cost ~45 us each (ktlong/kernels).
SPIN_COUNT = "30000"  # libgomp's spins before a thread sleeps (~0.3 ms by its own estimate)
OMP_SET = "KTLONG_OMP_SET"  # names of the settings ktlong set, not the user (children inherit it)
PEER = "KTLONG_PEER"  # "1": a benchmark's peer runtime (llama.cpp) runs with the user's settings


def _omp_defaults() -> None:
    if _os.environ.get(PEER) == "1":
        return
    set_here = []
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", SPIN_COUNT)):
        if name not in _os.environ:
            _os.environ[name] = value
            set_here.append(name)
    if set_here:
        ours = {k for k in _os.environ.get(OMP_SET, "").split(",") if k}
        _os.environ[OMP_SET] = ",".join(sorted(ours | set(set_here)))


_omp_defaults()


def _unshadow_kernels() -> None:
    """Run from the repository's root (`python -m ktlong`, a test child), the current folder
    heads sys.path and its kernels/ (ktlong.kernels' source) would shadow the `kernels` package
    transformers imports: that entry goes after site-packages."""
    import sys

    here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    ours = _os.path.join(here, "kernels", "__init__.py")
    for entry in list(sys.path):
        if _os.path.abspath(entry or ".") == here and _os.path.exists(ours):
            sys.path.remove(entry)
            sys.path.append(entry)


_unshadow_kernels()

__version__ = "0.1.0"
