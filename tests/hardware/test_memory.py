"""Host memory: the free-memory figure budgets use, and glibc keeping freed activations."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from splitphase.hardware.memory import available_host_memory_bytes

# Page faults per "layer" of activations (two 24 MiB and one 4 MiB, written, freed) once a
# process has run a few: kept memory serves them from the heap (the warm-up grows it past the
# fragmentation torch's aligned allocations leave, then it stays).
_FAULTS_PER_LAYER = """
import resource, sys, torch
from splitphase.hardware.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()

def layer():
    a, b = torch.empty(6 * 2**20).fill_(1.0), torch.empty(6 * 2**20).fill_(1.0)
    c = torch.empty(2**20).fill_(1.0)
    del a, b, c

for _ in range(20):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def test_available_memory_is_positive_and_below_the_machine() -> None:
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < available_host_memory_bytes() <= total


# Where a fresh process's first 24 MiB activation lives: glibc maps blocks that size afresh
# (its mmap threshold starts at 128 KiB), kept memory takes them from the heap.
_IN_HEAP = """
import sys, torch
from splitphase.hardware.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
ptr = torch.empty(6 * 2**20).data_ptr()
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        print(lo <= ptr < hi)
"""


def _child(code: str, mode: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code, mode], capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


@needs_glibc
def test_kept_memory_takes_activations_from_the_heap() -> None:
    assert _child(_IN_HEAP, "default") == "False"
    assert _child(_IN_HEAP, "keep") == "True"


@needs_glibc
def test_kept_memory_serves_activations_without_page_faults() -> None:
    # The default's figure varies with how glibc's thresholds happened to move (0 to ~12k
    # faults a layer); kept memory settles at none.
    assert float(_child(_FAULTS_PER_LAYER, "keep")) < 100


# How far RSS (MiB) falls once 400 MiB of 8 MiB blocks are freed into kept memory, with the
# trim ("trim") or without it.
_KEPT_THEN_TRIMMED = """
import sys, torch
from splitphase.hardware.memory import keep_freed_memory, return_freed_memory
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
assert keep_freed_memory()
blocks = [torch.ones(2 * 2**20) for _ in range(50)]
held = rss()
del blocks
if sys.argv[1] == "trim":
    assert return_freed_memory()
print(held - rss())
"""


@needs_glibc
def test_returning_freed_memory_gives_kept_blocks_back() -> None:
    assert int(_child(_KEPT_THEN_TRIMMED, "keep")) < 100  # kept: freed, still resident
    assert int(_child(_KEPT_THEN_TRIMMED, "trim")) > 300  # trimmed: most of the 400 MiB back
