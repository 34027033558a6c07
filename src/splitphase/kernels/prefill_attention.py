"""Causal prefill attention on CPU: the native flash-style kernel, or None (use torch SDPA).

Queries are the last T of a sequence's S positions (T = S for a whole prompt, T < S for a
chunk after a cached prefix). The kernel tiles queries and keys, keeps a running softmax,
skips key tiles above the diagonal and reads each K/V tile once for all the query heads of
its group (GQA), reading K/V in place: a strided view of the contiguous KV cache, or a paged
pool through slots. It computes in fp32 and covers fp32 or bf16 inputs (bf16 widened as K/V
and queries are copied into its tiles, the output rounded once) with a head_dim that is a
multiple of 16; anything else (GPU, fp16, autograd) is left to the caller's torch path.
On a CPU with AMX tiles bf16 Q K^T and P V multiply on them (attention_amx.h) where the head_dim
is a multiple of 32; otherwise there bf16 goes to torch's SDPA, whose flash kernel uses them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from splitphase.kernels import amx, build, skinny
from splitphase.kernels.switch import Switch, switch_functions

_SWITCH = Switch()
_vectorized: bool | None = None


def vectorized() -> bool:
    """Whether the loaded library's tiles are vector code (built for AVX-512, or AVX2 with
    FMA). Without either they are scalar loops, which on the AVX2-only AMD Zen 3 host (one
    layer of base-125m, fp32, `bench/prefill_attention_ab.py`) took 2.0x SDPA's time at 512
    tokens and 3.6x at 2048: there SDPA takes prefill attention. The AVX2 tiles took 0.55x
    SDPA's time at 512 tokens and 0.74x at 2048 (bf16: 0.45x and 0.67x) on that host."""
    global _vectorized
    if _vectorized is None:
        _vectorized = build.available() and bool(
            torch.ops.splitphase.prefill_attention_vectorized())
    return _vectorized


@contextlib.contextmanager
def scalar_tiles_allowed() -> Iterator[None]:
    """The kernel takes prefill attention inside the block even where its tiles are scalar
    loops (benchmarks time them there, tests check their results), as before after it."""
    global _vectorized
    before, _vectorized = vectorized(), build.available()
    try:
        yield
    finally:
        _vectorized = before


def _requires() -> bool:
    return skinny.is_enabled() and vectorized()


set_enabled, switched, is_enabled = switch_functions(
    _SWITCH, requires=_requires, module=__name__,
    set_doc="Turn the native prefill attention on or off for this process (torch SDPA when off).",
    switched_doc="Native prefill attention on (or off) inside the block, as it was after it.",
    enabled_doc=("True when this path is on, the native kernels are (SPLITPHASE_KERNELS=0 "
                 "turns all off) and their tiles are vector code (`vectorized`)."),
)


# bf16 through the native kernel, or through SDPA (off). Where the CPU has AMX tiles the
# kernel multiplies bf16 on them, and one layer of base-125m's attention (12 query heads over
# 4 K/V heads, the Intel AMX host; `bench/prefill_attention_ab.py --dtype bfloat16`, two runs)
# took 0.55-0.90x SDPA's time from 256 to 2048 tokens, 0.85-0.93x at 128, 1.15-1.33x at 64
# (0.17 ms against 0.14); SDPA's flash kernel (oneDNN's brgemm on the same tiles) had taken
# 0.39-0.79x the kernel's time without them (VDPBF16PS; session 25, 64-2048 tokens). So
# bf16 goes to SDPA only on an AMX CPU where the library has no tiles or the head_dim is no
# multiple of 32. Without AMX the kernel's VDPBF16PS path is the faster one (the AMD host,
# session 21: a bf16 prefill of 512 tokens 146.1 ms on it, 197.5 on SDPA).
_BF16 = Switch(on=True)
AMX_HEAD_DIM_MULTIPLE = 32  # the tiles' sums run over 32 bf16 values (attention_amx.h)
_amx_tiles: bool | None = None
_AMX = Switch(on=True)  # bf16 on the tiles (where they exist), mirrored into the library


def amx_tiles() -> bool:
    """Whether the loaded library multiplies bf16 attention on AMX tiles on this CPU."""
    global _amx_tiles
    if _amx_tiles is None:
        _amx_tiles = build.available() and bool(torch.ops.splitphase.set_amx_attention(True))
    return _amx_tiles


@contextlib.contextmanager
def amx_switched(on: bool) -> Iterator[None]:
    """bf16 on AMX tiles (on) or on VDPBF16PS (off) inside the block (nothing without tiles)."""
    if not amx_tiles():
        yield
        return
    before, _AMX.on = _AMX.on, on
    torch.ops.splitphase.set_amx_attention(on)
    try:
        yield
    finally:
        _AMX.on = before
        torch.ops.splitphase.set_amx_attention(before)


def bf16_switched(on: bool) -> contextlib.AbstractContextManager[None]:
    """bf16 through the native kernel (on) or torch's SDPA (off) inside the block."""
    return _BF16.switched(on)


def takes_bf16(head_dim: int | None = None) -> bool:
    """Whether bf16 inputs (of this head_dim) take the native kernel here: not on an AMX CPU
    where the kernel cannot use the tiles for them."""
    if not _BF16.on:
        return False
    if not amx.AMX_TILES:
        return True
    return amx_tiles() and (head_dim is None or head_dim % AMX_HEAD_DIM_MULTIPLE == 0)


def _rows_ok(x: torch.Tensor) -> bool:
    """Each row's heads contiguous (H*D values, any stride between rows): what the kernel reads."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


# The pools the paged kernel reads under each query dtype: its own, or a narrower one
# (kv_cache_dtype), widened as it packs its K/V tiles.
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
PAGED_POOL_DTYPES = {torch.float32: (torch.float32, torch.bfloat16, *_FP8),
                     torch.bfloat16: (torch.bfloat16, *_FP8)}


def _ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool = False) -> bool:
    if q.device.type != "cpu" or q.dtype not in PAGED_POOL_DTYPES:
        return False
    kv_dtypes = PAGED_POOL_DTYPES[q.dtype] if paged else (q.dtype,)
    if k.dtype not in kv_dtypes or v.dtype != k.dtype or k.shape != v.shape:
        return False
    if q.dtype == torch.bfloat16 and not takes_bf16(q.shape[-1]):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    heads, dim = q.shape[-2], q.shape[-1]
    if dim % 16 or k.shape[-1] != dim or heads % k.shape[-2]:
        return False
    return _rows_ok(q) and _rows_ok(k) and _rows_ok(v) and is_enabled()


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """q (B, T, H, D), the last T positions of k/v (B, S, G, D) -> (B, T, H*D), or None."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0]:
        return None
    if not 0 < q.shape[1] <= k.shape[1] or not _ok(q, k, v):
        return None
    return torch.ops.splitphase.prefill_attention(q, k, v)


def _sdpa_style_flops(
    q_shape: Sequence[int], k_shape: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    """4 * B * T * S * H * D: the full score matrix, as torch's FLOP counter counts SDPA."""
    b, t, h, d = (int(x) for x in q_shape)
    return 4 * b * t * int(k_shape[1]) * h * d


def register_flops() -> None:
    """Let FlopCounterMode (the audit's check of its FLOP model) see this op as it sees SDPA.

    Called by `build` once the library is loaded (the op exists only then). A counter copies
    the formulas when it is created, so load the kernels (`build.status()`) before counting."""
    register_flop_formula(torch.ops.splitphase.prefill_attention)(_sdpa_style_flops)


@dataclass(frozen=True)
class PagedChunks:
    """A step's prefill chunks, packed for one kernel call (varlen, like cu_seqlens).

    Chunk i's queries are rows q_rows[q_starts[i]:q_starts[i+1]] of the flattened batch, in
    position order, the last of its positions; slots[k_starts[i]:k_starts[i+1]] are the pool
    slots of its positions 0..S_i-1.
    """

    q_rows: torch.Tensor  # (sum T_i,) int64
    q_starts: torch.Tensor  # (C+1,) int64
    slots: torch.Tensor  # (sum S_i,) int64
    k_starts: torch.Tensor  # (C+1,) int64

    @classmethod
    def build(cls, chunks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> PagedChunks:
        """From (rows, context slots) per chunk; built once per step, read by every layer."""
        rows, slots = [r for r, _ in chunks], [s for _, s in chunks]

        def starts(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(len(p) for p in parts)])

        return cls(torch.cat(rows), starts(rows), torch.cat(slots), starts(slots))

    def valid(self) -> bool:
        """Every chunk has 1 <= T_i <= S_i (the kernel's contract); CPU int64 indices."""
        t, s = self.q_starts.diff(), self.k_starts.diff()
        same = all(x.dtype == torch.long and x.device.type == "cpu" for x in (
            self.q_rows, self.q_starts, self.slots, self.k_starts))
        return same and len(t) > 0 and bool(((t >= 1) & (t <= s)).all())


def causal_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    chunks: PagedChunks,
    out: torch.Tensor,
) -> bool:
    """Each chunk's rows of q (N, H, D) attend causally over k/v pools (P, G, D) at its slots;
    writes those rows of out (N, H*D). The pools may be narrower than q (PAGED_POOL_DTYPES).
    False when the kernel does not apply (nothing written).
    """
    if q.dim() != 3 or k_pool.dim() != 3:
        return False
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and out.is_contiguous()):
        return False
    if out.dtype != q.dtype or out.shape != (q.shape[0], q.shape[1] * q.shape[2]):
        return False
    if not _ok(q, k_pool, v_pool, paged=True):
        return False
    c = chunks
    torch.ops.splitphase.prefill_attention_paged(
        q, k_pool, v_pool, c.q_rows, c.q_starts, c.slots, c.k_starts, out
    )
    return True
