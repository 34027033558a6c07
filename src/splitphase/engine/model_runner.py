"""Runs the model for one SchedulerOutput: builds ids, positions, slot mapping and block tables.

All scheduled tokens form one flattened batch, so every shared GEMM runs once per step over
the whole batch. Every sampling row sits at the batch's tail: the last token of each final
prefill chunk, then every decode token. Logits (and a Dual-Flow model's auxiliary flow) run
on that contiguous block of rows only; prompt logits are computed when a request asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from splitphase.engine.kv_cache import PaddedQueries, PagedAttention, PagedKVCache, PrefillSlice
from splitphase.engine.policies import SchedulerOutput
from splitphase.hardware.huge_pages import weights_on_huge_pages
from splitphase.kernels import packed_linear
from splitphase.model.transformer import Transformer


@dataclass(frozen=True)
class RunnerOutput:
    """Logits (R, V) for the sampling rows, in `sample_ids` order; prompt logits if asked.

    For a Dual-Flow model the "logits" are log P of the mixed readout (softmax(log P) = P, so
    the sampler treats them like logits).
    """

    sample_ids: tuple[str, ...]
    logits: torch.Tensor
    prompt_logits: dict[str, torch.Tensor]  # request_id -> (num_tokens, V) for that chunk


@dataclass
class _Layout:
    """Where each token of a step sits in the flattened batch of N rows."""

    ids: list[int]
    positions: list[int]
    write_slots: list[int]
    prefills: list[tuple[list[int], torch.Tensor]]  # per chunk: rows (position order), context
    sample_ids: list[str]  # the tail rows' requests, in row order
    sample_contexts: list[torch.Tensor]  # per tail row: slots of positions [0, pos]
    prompt_rows: dict[str, list[int]]


def _padded(contexts: list[torch.Tensor], first_row: int, device: torch.device) -> PaddedQueries:
    """One single-token query per context, padded to the longest context."""
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.long)
    s_max = int(lengths.max()) if len(contexts) else 0
    slots = torch.zeros(len(contexts), s_max, dtype=torch.long)
    for i, ctx in enumerate(contexts):
        slots[i, : len(ctx)] = ctx
    mask = (torch.arange(s_max) < lengths[:, None])[:, None, None]  # (B, 1, 1, S_max)
    return PaddedQueries(first_row, slots.to(device), mask.to(device), lengths.to(device))


class ModelRunner:
    """Owns the model and the paged KV pool of one worker."""

    def __init__(self, model: Transformer, cache: PagedKVCache) -> None:
        self.model, self.cache = model, cache
        self.device = model.device
        if self.device.type == "cpu":
            weights_on_huge_pages(model)  # batched decode steps 1-5% faster (huge_pages.py)
        self.has_aux_flow = bool(getattr(model, "has_aux_flow", False))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A throwaway prefill and decode step on a scratch cache, as vLLM warms up at start:
        the native kernels load and the prefill GEMMs pack their weights here, not inside the
        first request's TTFT (measured: embedded model, first prefill 79 ms, then 6-7 ms)."""
        model = self.model
        tokens = min(packed_linear.MIN_ROWS, model.cfg.max_seq_len - 1)
        ids = torch.zeros((1, tokens), dtype=torch.long, device=model.device)
        _, scratch = model.prefill(ids, model.new_cache(1, tokens + 1))
        model.decode_step(ids[:, -1], scratch)

    def _layout(self, out: SchedulerOutput, want_prompt: set[str]) -> _Layout:
        samples = [c.is_last_chunk and c.num_samples > 0 for c in out.prefill]
        n_body = sum(c.num_tokens - s for c, s in zip(out.prefill, samples, strict=True))
        n = out.num_batched_tokens
        lay = _Layout([0] * n, [0] * n, [0] * n, [], [], [], {})
        body, tail = 0, n_body
        for c, sample in zip(out.prefill, samples, strict=True):
            ctx = self.cache.slots(c.block_table, 0, c.end)
            rows = list(range(body, body + c.num_tokens - sample))
            body += len(rows)
            if sample:
                rows.append(tail)
                tail += 1
                lay.sample_ids.append(c.request_id)
                lay.sample_contexts.append(ctx)
            for i, row in enumerate(rows):
                lay.ids[row], lay.positions[row] = c.token_ids[i], c.start + i
                lay.write_slots[row] = int(ctx[c.start + i])
            lay.prefills.append((rows, ctx))
            if c.request_id in want_prompt:
                lay.prompt_rows[c.request_id] = rows
        dec = out.decode
        for rid, pos, tok, table in zip(
            dec.request_ids, dec.positions, dec.token_ids, dec.block_tables, strict=True
        ):
            ctx = self.cache.slots(table, 0, pos + 1)
            lay.ids[tail], lay.positions[tail], lay.write_slots[tail] = tok, pos, int(ctx[-1])
            tail += 1
            lay.sample_ids.append(rid)
            lay.sample_contexts.append(ctx)
        return lay

    def _context(self, lay: _Layout, num_decodes: int) -> PagedAttention:
        dev = self.device
        n, a = len(lay.ids), len(lay.sample_ids)
        prefills = [
            PrefillSlice(torch.tensor(rows, dtype=torch.long, device=dev), ctx.to(dev))
            for rows, ctx in lay.prefills
        ]
        decodes = _padded(lay.sample_contexts[a - num_decodes :], n - num_decodes, dev)
        # The auxiliary queries arrive on their own (A rows), so they start at row 0.
        aux = _padded(lay.sample_contexts, 0, dev) if self.has_aux_flow else None
        write = torch.tensor(lay.write_slots, dtype=torch.long, device=dev)
        return PagedAttention(self.cache, write, prefills, decodes, aux)

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
        if out.num_batched_tokens == 0:
            return RunnerOutput((), torch.empty(0), {})
        lay = self._layout(out, want_prompt or set())
        ctx = self._context(lay, len(out.decode))
        ids = torch.tensor([lay.ids], dtype=torch.long, device=self.device)  # (1, N)
        pos = torch.tensor([lay.positions], dtype=torch.long, device=self.device)  # (1, N)
        a = len(lay.sample_ids)
        if self.has_aux_flow:
            logits, hidden = self._run_dual_flow(ids, pos, ctx, a, decode_only=not out.prefill)
        else:
            hidden = self.model.hidden_states(ids, pos, ctx)[0]  # (N, D)
            logits = self.model.logits(hidden[len(lay.ids) - a :], len(lay.ids))  # (A, V)
        prompt_logits = {rid: self.model.logits(hidden[r]) for rid, r in lay.prompt_rows.items()}
        return RunnerOutput(tuple(lay.sample_ids), logits, prompt_logits)

    def _run_dual_flow(
        self, ids: torch.Tensor, pos: torch.Tensor, ctx: PagedAttention, a: int, decode_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log P (A, V) for the sampling rows, and the primary's hidden states (N, D).

        A decode-only step runs both flows as one grouped pass ((N, 1) layout); a step with
        prefill runs the primary over all rows, then the auxiliary flow at the A sampling rows
        only (the last prompt position of each final chunk and every decode token). Prompt
        logprobs of a Dual-Flow model are the primary flow's.
        """
        model: Any = self.model  # a DualFlowTransformer (has_aux_flow)
        if decode_only:
            hp, hq = model.run_flows(ids.T, pos.T, ctx, 1, grouped=True)  # (N, 1, D) each
            flows = model.flow_outputs(hp[:, 0], None if hq is None else hq[:, 0], grouped=True)
            return flows.log_probs, hp[:, 0]
        hp, hq = model.run_flows(ids, pos, ctx, a, grouped=False)  # (1, N, D), (1, A, D)
        flows = model.flow_outputs(hp[0, -a:], None if hq is None else hq[0], grouped=False)
        return flows.log_probs, hp[0]
