"""Whether this CPU has AMX tiles: there oneDNN (torch's bf16 GEMMs, its CPU flash attention)
multiplies bf16 on them, which changes which path wins (`packed_linear.min_rows`,
`prefill_attention`). Whether our own library has them is `skinny.amx_kernel()`."""

from __future__ import annotations

import torch


def cpu_has_amx_tiles() -> bool:
    """True where oneDNN can multiply bf16 on AMX tiles (torch's own CPU probe)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


AMX_TILES = cpu_has_amx_tiles()
