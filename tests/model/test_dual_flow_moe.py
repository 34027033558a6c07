"""Dual-Flow MoE routing (k1 / k2 experts per flow, replay, inference overrides) and parameter
counts against the audit's closed forms."""

from __future__ import annotations

import pytest
import torch
from test_dual_flow import dual, ids_for

from splitphase.audit import flops
from splitphase.model.config import ModelConfig
from splitphase.model.dual_flow import DualFlowTransformer
from splitphase.model.dual_flow_layers import (
    RoutingRecord,
    coupling_b_width,
    expert_mix,
    moe_grouped,
    replay_route,
    top_k_route,
)
from splitphase.model.moe import MoE


def traced(model: DualFlowTransformer, ids: torch.Tensor) -> tuple[list, list]:
    """Routing records of a prefill over ids[:, :-1] and one grouped decode step of ids[:, -1]."""
    model.routing_trace = []
    _, cache = model.prefill(ids[:, :-1])
    prefill, model.routing_trace = model.routing_trace, []
    model.decode_step(ids[:, -1], cache)
    decode, model.routing_trace = model.routing_trace, None
    return prefill, decode


def by_flow(records: list[RoutingRecord], flow: str) -> list[torch.Tensor]:
    return [r.experts for r in sorted(records, key=lambda r: r.layer_idx) if r.flow == flow]


def distinct_per_row(experts: torch.Tensor) -> bool:
    return all(len(set(row.tolist())) == experts.shape[1] for row in experts)


def test_each_flow_routes_exactly_its_own_k() -> None:
    model = dual("tiny-moe", aux_top_k=3)  # k1 = top_k = 2, k2 = 3
    prefill, decode = traced(model, ids_for(model, 2, 7))
    layers = model.cfg.n_layers
    for records, primary_tokens in ((prefill, 2 * 6), (decode, 2)):
        primary, aux = by_flow(records, "primary"), by_flow(records, "aux")
        assert len(primary) == len(aux) == layers
        assert all(e.shape == (primary_tokens, 2) and distinct_per_row(e) for e in primary)
        assert all(e.shape == (2, 3) and distinct_per_row(e) for e in aux)  # one aux row each


def test_replay_reuses_the_primary_indices_with_own_gates() -> None:
    model = dual("tiny-moe", aux_routing="replay")
    ids = ids_for(model, 2, 7)
    prefill, decode = traced(model, ids)
    for pri, aux in zip(by_flow(decode, "primary"), by_flow(decode, "aux"), strict=True):
        assert torch.equal(pri, aux)
    for pri, aux in zip(by_flow(prefill, "primary"), by_flow(prefill, "aux"), strict=True):
        assert torch.equal(pri.unflatten(0, (2, 6))[:, -1], aux)  # the last prompt position


def test_replay_gates_come_from_the_aux_router_logits() -> None:
    model = dual("tiny-moe", live_couplings=False, aux_routing="replay")
    moe, cp = model.layers[0].mlp, model.couplings[0]
    assert isinstance(moe, MoE) and moe.shared is not None
    torch.manual_seed(3)
    y1, y2 = torch.randn(3, 64), torch.randn(3, 64)
    settings = model.flow_settings()
    with torch.no_grad():
        _, m2, _, i1 = moe_grouped(moe, cp, y1, y2, settings, 0)
        w2 = replay_route(moe.router(y2), i1, y2.dtype)  # (3, k1)
        w1, _ = top_k_route(moe.router(y1), 2, y1.dtype)
        rows = torch.arange(3)[:, None].expand_as(i1).flatten()

        def routed(weights: torch.Tensor) -> torch.Tensor:
            return expert_mix(moe, y2, weights.flatten(), i1.flatten(), rows) + moe.shared(y2)

        close = torch.testing.assert_close
        close(m2, routed(w2), atol=1e-6, rtol=1e-5)
        assert (m2 - routed(w1)).abs().max() > 1e-4  # not the primary's gate weights
        close(w2.sum(-1), torch.ones(3))


def test_top_k_overrides_at_inference() -> None:
    model = dual("tiny-moe")
    ids = ids_for(model, 2, 7)
    with torch.no_grad():
        default = model.forward_flows(ids)
    model.primary_top_k, model.aux_top_k = 1, 4
    prefill, decode = traced(model, ids)
    assert all(e.shape[1] == 1 for e in by_flow(prefill + decode, "primary"))
    assert all(e.shape[1] == 4 for e in by_flow(prefill + decode, "aux"))
    with torch.no_grad():
        changed = model.forward_flows(ids)
    assert not torch.equal(changed.logits_p, default.logits_p)
    model.aux_top_k = 5
    with pytest.raises(ValueError, match=r"aux_top_k must be in \[1, 4\]"):
        model.forward(ids)
    model.aux_top_k, model.aux_routing = 2, "shared"
    with pytest.raises(ValueError, match="aux_routing must be one of"):
        model.forward(ids)


def test_replay_override_at_inference_follows_the_primary() -> None:
    model = dual("tiny-moe", aux_top_k=3)
    model.aux_routing = "replay"
    _, decode = traced(model, ids_for(model, 2, 5))
    for pri, aux in zip(by_flow(decode, "primary"), by_flow(decode, "aux"), strict=True):
        assert torch.equal(pri, aux)  # replay takes k1 indices whatever aux_top_k says


# ---------------------------------------------------------------- parameters vs the audit


def _params(cfg: ModelConfig) -> int:
    return sum(p.numel() for p in DualFlowTransformer(cfg).parameters())


CASES = [(p, c) for p in ("tiny", "tiny-moe") for c in ("none", "ac", "abc")]


@pytest.mark.parametrize(
    ("preset", "coupling"),
    CASES,
)
def test_param_count_matches_the_audit(preset: str, coupling: str) -> None:
    cfg = ModelConfig.from_name(preset).with_(arch="dual_flow", coupling=coupling)
    assert _params(cfg) == flops.param_count(cfg)


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_moe_coupling_b_spans_the_shared_experts(shared: int) -> None:
    cfg = ModelConfig.from_name("tiny-moe").with_(arch="dual_flow", n_shared_experts=shared)
    model = DualFlowTransformer(cfg)
    b = model.couplings[0].b
    assert coupling_b_width(cfg) == shared * cfg.d_expert
    assert (b is None) if shared == 0 else (b.numel() == shared * cfg.d_expert)
    base = ModelConfig.from_name("tiny-moe").with_(n_shared_experts=shared)
    per_layer = cfg.q_dim + cfg.d_model + coupling_b_width(cfg)
    extra = cfg.vocab_size * cfg.d_model + cfg.n_layers * per_layer
    assert _params(cfg) == flops.param_count(base) + extra


def test_couplings_start_at_zero_and_off_modes_have_no_parameters() -> None:
    torch.manual_seed(0)
    model = DualFlowTransformer(ModelConfig.from_name("tiny").with_(arch="dual_flow"))
    assert all(torch.count_nonzero(p) == 0 for p in model.couplings.parameters())
    none = DualFlowTransformer(
        ModelConfig.from_name("tiny").with_(arch="dual_flow", coupling="none")
    )
    assert not list(none.couplings.parameters())
    names = {n for n, _ in model.named_parameters() if n.startswith("couplings.0.")}
    assert names == {"couplings.0.a", "couplings.0.b", "couplings.0.c"}
