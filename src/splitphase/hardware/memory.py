"""Host memory free to use: what memory budgets (KV cache, packed weights) take a share of."""

from __future__ import annotations

import os


def available_host_memory_bytes() -> int:
    """MemAvailable (free plus reclaimable cache), or the free page count where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
