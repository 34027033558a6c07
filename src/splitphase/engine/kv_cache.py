"""The paged KV cache: one tensor pool of fixed-size blocks, read and written through block tables.

The pool is (L, num_blocks * block_size, G, D) for K and for V: a slot is
`block_id * block_size + offset`, the same slot mapping as vLLM. `PagedAttention` is the
attention context of one engine step over a flattened batch (all scheduled tokens in one row):
it writes each token's K/V into its slot, then each prefill chunk attends over its request's
context, and all decode tokens attend together over their padded contexts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from splitphase.errors import UserError
from splitphase.hardware.memory import available_host_memory_bytes
from splitphase.kernels import prefill_attention
from splitphase.kernels.attention import decode_attention
from splitphase.kernels.decode_stack import DecodePlan
from splitphase.model.config import ModelConfig
from splitphase.model.layers import Attention, causal_mask


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes of K and V for one block across all layers."""
    return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for an EngineConfig.kv_cache_dtype ("auto": the model's own)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return _FP8_DTYPES.get(kv_cache_dtype) or getattr(torch, kv_cache_dtype)


def write_pool_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[slots] = rows, rounded to the pool's dtype (which may be narrower than the model's).
    torch has no CPU index_copy_ for fp8: one-byte pools take the rows as bytes."""
    narrow = rows.to(pool.dtype)
    if pool.element_size() == 1:
        pool.view(torch.uint8).index_copy_(0, slots, narrow.view(torch.uint8))
    else:
        pool.index_copy_(0, slots, narrow)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA: mem_get_info; CPU: MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_host_memory_bytes()


def num_blocks_for_budget(
    cfg: ModelConfig,
    block_size: int,
    dtype_bytes: int,
    kv_cache_bytes: int | None,
    memory_fraction: float,
    device: torch.device,
    max_num_seqs: int,
    max_len: int | None = None,
) -> int:
    """How many blocks fit a byte budget, or a fraction of the device's free memory.

    A fraction of free memory is capped at what max_num_seqs full-length sequences can use
    (`max_len` tokens each, default the model's max_seq_len), so a small model on a big machine
    does not zero gigabytes it will never touch.
    """
    per_block = kv_bytes_per_block(cfg, block_size, dtype_bytes)
    if kv_cache_bytes is None:
        if not 0 < memory_fraction <= 1:
            raise UserError(f"KV memory fraction must be in (0, 1], got {memory_fraction}")
        full = min(cfg.max_seq_len, max_len or cfg.max_seq_len)
        useful_bytes = max_num_seqs * -(-full // block_size) * per_block
        kv_cache_bytes = min(int(available_memory_bytes(device) * memory_fraction), useful_bytes)
    num_blocks = kv_cache_bytes // per_block
    if num_blocks < 1:
        raise UserError(
            f"--kv-cache-bytes {kv_cache_bytes} holds no block; one block of {block_size} tokens "
            f"needs {per_block} bytes for this model"
        )
    return int(num_blocks)


class PagedKVCache:
    """K and V pools for every layer: (L, num_blocks * block_size, G, D)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.n_layers, num_blocks * block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src, dst) in every layer: a forked sequence's partial last block."""
        bs = self.block_size
        for src, dst in copies:
            self.k[:, dst * bs : (dst + 1) * bs] = self.k[:, src * bs : (src + 1) * bs]
            self.v[:, dst * bs : (dst + 1) * bs] = self.v[:, src * bs : (src + 1) * bs]

    def slots(self, block_table: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) of a sequence."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass(frozen=True)
class PrefillSlice:
    """A prefill chunk inside the flattened batch: its rows, in position order."""

    rows: torch.Tensor  # (T,) row of each fed token (the sampling row sits at the batch's tail)
    context_slots: torch.Tensor  # (context_len,) slots of positions [0, end)


@dataclass(frozen=True)
class PaddedQueries:
    """Single-token queries, each over its own sequence's context, padded to one batch."""

    first_row: int  # these queries are rows [first_row, first_row + B) of their input
    slots: torch.Tensor  # (B, S_max) context slots, padded
    mask: torch.Tensor  # (B, 1, 1, S_max) True where a slot is real
    lengths: torch.Tensor  # (B,) real slots per row (>= 1)

    def attend(
        self, attn: Attention, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """q (1, N, H, D) -> (1, B, H*D) for rows [first_row, first_row + B)."""
        b = self.slots.shape[0]
        qd = q[0, self.first_row : self.first_row + b]  # (B, H, D)
        # The pool is read in place (native kernel) or gathered once per layer (torch).
        out = decode_attention(qd, k_pool, v_pool, self.slots, self.lengths, self.mask)
        return out.flatten(1)[None]  # (1, B, H*D)


class PagedAttention:
    """Attention context of one step: writes K/V into slots, reads through block tables.

    Inputs come flattened, (1, N, ...) or (N, 1, ...) for a grouped decode. A Dual-Flow
    auxiliary query (`attend_cached` with the A sampling rows only) attends like a decode
    token over its sequence's context, up to and including its own position.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        write_slots: torch.Tensor,
        prefills: list[PrefillSlice],
        decodes: PaddedQueries,
        aux: PaddedQueries | None = None,
    ) -> None:
        self.cache = cache
        self.write_slots = write_slots  # (N,) one slot per token of the flattened batch
        self.prefills = prefills
        self.decodes = decodes  # the decode tokens: the last rows of the batch
        self.aux = aux  # the sampling rows' contexts, for the auxiliary flow
        self.num_rows = write_slots.shape[0]
        chunks = prefill_attention.PagedChunks.build(
            [(p.rows, p.context_slots) for p in prefills]) if prefills else None
        self._chunks = chunks if chunks is not None and chunks.valid() else None

    def decode_plan(self) -> DecodePlan | None:
        """The step as pool slots when every row is a decode token (else None)."""
        d = self.decodes
        if self.prefills or d.first_row != 0 or d.slots.shape[0] != self.num_rows:
            return None
        return DecodePlan(self.cache.k, self.cache.v, self.write_slots, d.slots, d.lengths)

    def attend(
        self, layer_idx: int, attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q (1, N, H, D) or (N, 1, H, D), k/v likewise with G heads -> (.., .., H*D)."""
        write_pool_rows(self.cache.k[layer_idx], self.write_slots, k.flatten(0, 1))
        write_pool_rows(self.cache.v[layer_idx], self.write_slots, v.flatten(0, 1))
        return self._attend_all(layer_idx, attn, q)

    def attend_cached(self, layer_idx: int, attn: Attention, q: torch.Tensor) -> torch.Tensor:
        """Read-only attention over the pool: the whole batch, or the auxiliary rows only."""
        rows = q.shape[0] * q.shape[1]
        if self.aux is not None and rows == self.aux.slots.shape[0] and rows != self.num_rows:
            flat = q.reshape(1, rows, *q.shape[2:])
            out = self.aux.attend(attn, flat, self.cache.k[layer_idx], self.cache.v[layer_idx])
            return out.reshape(*q.shape[:2], -1)
        return self._attend_all(layer_idx, attn, q)

    def _native_prefill(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor
    ) -> bool:
        """All prefill chunks in one native call, reading the pool and the rows in place (a
        bf16 or fp8 pool under wider queries too: the kernel widens as it packs its tiles).
        Other pairs (an fp16 pool, a pool wider than q) give the kernel the chunks' contexts
        converted into a compact pool first."""
        chunks = self._chunks
        if chunks is None:
            return False
        if k_pool.dtype not in prefill_attention.PAGED_POOL_DTYPES.get(q.dtype, ()):
            k_pool = k_pool.index_select(0, chunks.slots).to(q.dtype)
            v_pool = v_pool.index_select(0, chunks.slots).to(q.dtype)
            chunks = replace(chunks, slots=torch.arange(chunks.slots.numel()))
        return prefill_attention.causal_paged(q, k_pool, v_pool, chunks, out)

    def _attend_all(self, layer_idx: int, attn: Attention, q: torch.Tensor) -> torch.Tensor:
        flat = q.reshape(1, self.num_rows, *q.shape[2:])  # (1, N, H, D)
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]
        out = torch.empty(
            1, self.num_rows, flat.shape[2] * flat.shape[3], dtype=q.dtype, device=q.device
        )
        native = self._native_prefill(flat[0], k_pool, v_pool, out[0])
        for p in [] if native else self.prefills:
            qc = flat[:, p.rows]  # (1, T, H, D)
            kc = k_pool[p.context_slots][None].to(q.dtype)  # (1, S, G, D)
            vc = v_pool[p.context_slots][None].to(q.dtype)
            t, s = qc.shape[1], kc.shape[1]
            mask = None if s == t else causal_mask(t, s, q.device)
            out[:, p.rows] = attn.attend(qc, kc, vc, mask=mask, causal=mask is None)
        if self.decodes.slots.numel():
            b = self.decodes.slots.shape[0]
            first = self.decodes.first_row
            out[:, first : first + b] = self.decodes.attend(attn, flat, k_pool, v_pool)
        return out.reshape(*q.shape[:2], -1)
