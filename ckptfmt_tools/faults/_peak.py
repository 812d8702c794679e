"""How much a step of a fault check raised this process's peak resident set.

``ru_maxrss`` is a high-water mark since the process started (and, on Linux, it starts from the
parent's RSS at fork), so its delta over a step undercounts whenever the process peaked earlier.
:func:`peak_meter` resets the kernel's peak (``VmHWM``, by writing 5 to ``/proc/self/clear_refs``,
Linux >= 4.0) and measures the step's own peak against the RSS it started from; where that is not
available it falls back to the ``ru_maxrss`` delta, which is a lower bound.
"""
from __future__ import annotations

import resource
from typing import Callable

__all__ = ["peak_meter"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def peak_meter() -> Callable[[], int]:
    """Start measuring; the returned function gives the MiB the peak RSS rose above the start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _status_kib("VmRSS")
        return lambda: max(0, _status_kib("VmHWM") - start) // 1024
    except OSError:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return lambda: max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) // 1024
