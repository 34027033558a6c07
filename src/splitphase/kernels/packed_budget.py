"""The memory the packed GEMM copies of weights may take (`packed_linear`'s `auto` mode)."""

from __future__ import annotations

import torch

from splitphase.hardware.memory import available_host_memory_bytes

# The share of available memory packed copies may take under `auto`: a few percent leaves the
# KV cache (a quarter of free memory by default) and the OS theirs.
AUTO_MEMORY_FRACTION = 0.10


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Budget:
    """Bytes of packed copies alive in this process against the `auto` limit (none when on)."""

    def __init__(self, limited: bool) -> None:
        self.limited = limited
        self.limit_bytes: int | None = None
        self.used_bytes = 0

    def admit(self, nbytes: int) -> bool:
        """Count `nbytes` more if they fit (the limit is fixed at the first copy); else False."""
        if self.limited and self.limit_bytes is None:
            self.limit_bytes = int(AUTO_MEMORY_FRACTION * available_host_memory_bytes())
        if self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes:
            return False
        self.used_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
