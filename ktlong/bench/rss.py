"""Peak resident memory of this process, for benchmarks that run each measurement in a child."""
from __future__ import annotations

import resource
from pathlib import Path


def peak_rss(reset: bool = False) -> int:
    """This process's peak RSS in bytes (VmHWM), optionally reset to the current RSS first.

    ru_maxrss is no use in a child: Linux carries the parent's high-water mark across fork + exec.
    """
    status = Path("/proc/self/status")
    if not status.exists():  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    for line in status.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
