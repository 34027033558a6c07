"""Runs the model for one SchedulerOutput: builds ids, positions, slot mapping and block tables.

All scheduled tokens form one flattened batch row (prefill chunks first, then one token per
decode), so every shared GEMM runs once per step over the whole batch. Logits are computed
only at the positions that sample: the last position of a final prefill chunk, and every
decode token (plus, when asked, every prompt position for prompt logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitphase.engine.kv_cache import PagedAttention, PagedKVCache, PrefillSlice
from splitphase.engine.policies import SchedulerOutput
from splitphase.model.transformer import Transformer


@dataclass(frozen=True)
class RunnerOutput:
    """Logits (R, V) for the sampling rows, in `sample_ids` order; prompt logits if asked."""

    sample_ids: tuple[str, ...]
    logits: torch.Tensor
    prompt_logits: dict[str, torch.Tensor]  # request_id -> (num_tokens, V) for that chunk


class ModelRunner:
    """Owns the model and the paged KV pool of one worker."""

    def __init__(self, model: Transformer, cache: PagedKVCache) -> None:
        self.model, self.cache = model, cache
        self.device = model.device

    def _build(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, PagedAttention]:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        write: list[torch.Tensor] = []
        prefills: list[PrefillSlice] = []
        for c in out.prefill:
            ctx = self.cache.slots(c.block_table, 0, c.end)
            prefills.append(PrefillSlice(len(ids), c.num_tokens, ctx.to(self.device)))
            ids.extend(c.token_ids)
            positions.append(torch.arange(c.start, c.end))
            write.append(ctx[c.start :])
        decode_row = len(ids)
        s_max = max((d.context_len for d in out.decode), default=0)
        dec_slots = torch.zeros(len(out.decode), s_max, dtype=torch.long)
        dec_mask = torch.zeros(len(out.decode), 1, 1, s_max, dtype=torch.bool)
        for i, d in enumerate(out.decode):
            ctx = self.cache.slots(d.block_table, 0, d.context_len)
            dec_slots[i, : d.context_len] = ctx
            dec_mask[i, ..., : d.context_len] = True
            ids.append(d.token_id)
            positions.append(torch.tensor([d.position]))
            write.append(ctx[-1:])
        ctx_obj = PagedAttention(
            self.cache,
            torch.cat(write).to(self.device),
            prefills,
            decode_row,
            dec_slots.to(self.device),
            dec_mask.to(self.device),
        )
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, N)
        pos_t = torch.cat(positions).to(self.device)[None]  # (1, N)
        return ids_t, pos_t, ctx_obj

    def _sample_rows(
        self, out: SchedulerOutput, want_prompt: set[str]
    ) -> tuple[list[str], list[int], dict[str, tuple[int, int]]]:
        ids, rows, prompt_rows = [], [], {}
        row = 0
        for c in out.prefill:
            if c.request_id in want_prompt:
                prompt_rows[c.request_id] = (row, row + c.num_tokens)
            row += c.num_tokens
            if c.is_last_chunk and c.num_samples > 0:
                ids.append(c.request_id)
                rows.append(row - 1)
        for d in out.decode:
            ids.append(d.request_id)
            rows.append(row)
            row += 1
        return ids, rows, prompt_rows

    def load_kv(
        self, out: SchedulerOutput, payloads: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Decode worker: write transferred K/V (L, T, G, D) of each kv_load into its blocks."""
        for load in out.kv_loads:
            k, v = payloads.pop(load.request_id)
            slots = self.cache.slots(load.block_table, load.start, load.start + load.num_tokens)
            slots = slots.to(self.device)
            part = slice(load.start, load.start + load.num_tokens)
            self.cache.k[:, slots] = k[:, part].to(self.cache.k.device, self.cache.k.dtype)
            self.cache.v[:, slots] = v[:, part].to(self.cache.v.device, self.cache.v.dtype)

    def export_kv(
        self, block_table: tuple[int, ...], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill worker: K and V (L, T, G, D) of positions [0, num_tokens) of a sequence."""
        slots = self.cache.slots(block_table, 0, num_tokens).to(self.device)
        return self.cache.k[:, slots].contiguous(), self.cache.v[:, slots].contiguous()

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        want_prompt: set[str] | None = None,
        kv_payloads: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> RunnerOutput:
        """Run one step; the KV pool is updated in place (transferred K/V loaded first)."""
        if out.block_copies:
            self.cache.copy_blocks(list(out.block_copies))
        if out.kv_loads:
            self.load_kv(out, kv_payloads if kv_payloads is not None else {})
        sample_ids, rows, prompt_rows = self._sample_rows(out, want_prompt or set())
        if out.num_batched_tokens == 0:
            return RunnerOutput((), torch.empty(0), {})
        ids, positions, ctx = self._build(out)
        hidden = self.model.hidden_states(ids, positions, ctx)[0]  # (N, D)
        logits = self.model.logits(hidden[rows])  # (R, V)
        prompt_logits = {rid: self.model.logits(hidden[a:b]) for rid, (a, b) in prompt_rows.items()}
        return RunnerOutput(tuple(sample_ids), logits, prompt_logits)
