"""Peak memory of a block of code: CUDA allocator peak, or sampled process RSS on CPU.

On CUDA the number is exact: ``max_memory_allocated`` minus what was allocated on entry.
On CPU there is no allocator counter, so a background thread samples the resident set
size (``/proc/self/statm``, Linux) every ``interval`` seconds and reports the peak above
the value on entry; where that file is missing the CPU peak is ``None``.
"""

from __future__ import annotations

import os
import threading
import time

import torch

__all__ = ["PeakMemory", "current_rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int | None:
    """Resident set size of this process in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class PeakMemory:
    """Context manager; after exit ``peak_bytes`` is the peak extra memory inside the block."""

    def __init__(self, device: str | torch.device, interval: float = 0.002):
        self.device = torch.device(device)
        self.interval = interval
        self.peak_bytes: int | None = None
        self.kind = "cuda_allocated" if self.device.type == "cuda" else "cpu_rss"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base = 0
        self._max = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = current_rss_bytes()
            if rss is not None:
                self._max = max(self._max, rss)
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            rss = current_rss_bytes()
            if rss is not None:
                self._base = self._max = rss
                self._thread = threading.Thread(target=self._sample, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            rss = current_rss_bytes()
            if rss is not None:
                self._max = max(self._max, rss)
            self.peak_bytes = int(self._max - self._base)
