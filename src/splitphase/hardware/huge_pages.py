"""Large CPU weights on 2 MiB pages (Linux transparent huge pages).

torch's CPU tensors come from malloc on 4 KiB pages, so a decode step that streams base-125m's
0.5 GB of weights touches about 125,000 pages, each a TLB miss and a page walk. On the Zen 3
host (AVX2, 2 threads), the same model with its weights copied into memory advised for huge
pages, the two stepped in alternation in one process (8 steps a burst, best of each, four
rounds, either one first): batch 16 at context 128 took 0.95-0.99x the time, batch 32
0.96-0.99x, batch 8 at context 512 0.95-1.0x, batch 1 0.98-1.03x (nothing: its one pass over
each row is the memory's pace). The cost is a copy of each weight once, at engine start; the
old copies' memory goes back to the OS (`return_freed_memory`).

Only tensors of at least one huge page are moved; where the kernel has transparent huge pages
off, or the mapping fails, tensors stay where they are.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

from splitphase.hardware.memory import return_freed_memory

HUGE_PAGE_BYTES = 2 * 2**20
_MADV_HUGEPAGE = 14  # <linux/mman.h>
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> bool:
    """Whether this kernel backs memory advised with MADV_HUGEPAGE by huge pages ("always" or
    "madvise"; not "never", not a kernel without THP)."""
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def _madvise_huge(addr: int, nbytes: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_copy(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous copy of CPU tensor `t` in fresh private memory, 2 MiB aligned and advised
    for huge pages before its first touch (the copy's page faults then take whole huge pages);
    None where it cannot be made. The tensor keeps its mapping alive (torch.frombuffer)."""
    nbytes = t.numel() * t.element_size()
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    try:
        # An extra huge page of room to align the start: mmap guarantees only 4 KiB.
        buf = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    start = -(-addr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    if not _madvise_huge(start, size):
        return None
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=start - addr)
    return out.view(t.shape).copy_(t)


def weights_on_huge_pages(module: torch.nn.Module) -> int:
    """Moves each CPU parameter of at least one huge page into a huge-page copy, in place
    (`param.data`: tied weights stay tied, and a module's `_apply` hook sees the change, as
    for `.to()`). Returns the bytes moved; 0 where THP is off or all were moved before."""
    tensors = [*module.parameters(), *module.buffers()]
    if not transparent_huge_pages() or not any(_wants_move(t) for t in tensors):
        return 0  # and `_apply` does not run: the model keeps its cached weight lists
    moved = 0

    def move(t: torch.Tensor) -> torch.Tensor:
        nonlocal moved
        copy = huge_page_copy(t.detach()) if _wants_move(t) else None
        if copy is None:
            return t
        moved += t.numel() * t.element_size()
        return copy

    with torch.no_grad():
        module._apply(move)
    return_freed_memory()  # the old copies: malloc would keep them (keep_freed_memory)
    return moved


def _wants_move(t: torch.Tensor) -> bool:
    # 2 MiB-aligned: a copy made here already (a tied weight comes round once per module that
    # holds it; a second engine over the same model finds them all), or, rarely, a malloc'd
    # tensor that happens to be, which then stays where it is.
    big = t.numel() * t.element_size() >= HUGE_PAGE_BYTES
    return t.device.type == "cpu" and big and t.data_ptr() % HUGE_PAGE_BYTES != 0
