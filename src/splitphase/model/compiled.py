"""Optional torch.compile of the model's prefill and decode passes (off by default).

Piecewise, as vLLM compiles its models: the dense work between two attentions (o_proj, the
residual adds and norms, the MLP, the next layer's Q/K/V and rotation) is one compiled graph,
and attention runs eagerly between the pieces. So every attention context (the contiguous
cache, the engine's paged pool) works unchanged, the graphs hold no cache state, and one
graph serves every layer (the layers are arguments, their weights graph inputs).

Shapes are dynamic from the first call (`dynamic=True`): a new prompt length or decode batch
reuses the graph; dynamo still specialises a size of 1, and guards on the native kernels' row
limit when they are traced, so a piece holds a few graphs, never one per length. Dynamo's
recompile limit bounds the rest (past it, that piece runs eagerly: slower, never wrong).

`SPLITPHASE_COMPILE` = `prefill`, `decode` or `1` (both) turns it on for the process, as do
`set_enabled` and `switched`. It applies to inference passes (grad off) of dense models; MoE
routing is data-dependent and stays eager, as does training. A decode pass that the native
one-call decode stack serves (kernels/decode_stack.py) keeps it: it measured 10-15% faster
than the compiled pieces, which replace its per-layer Python with guarded graph calls but not
its single trip through the layers. So compiled decode runs where the stack does not (GPU,
QK-norm models, native kernels off). Inside the pieces the native
kernels are either traced as opaque ops (their fakes: kernels/fake.py) or switched off so
inductor compiles the torch reference path (`native_in_graph`), per phase, as measured best.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from splitphase.kernels import skinny
from splitphase.kernels.switch import PhaseSwitches

if TYPE_CHECKING:
    from splitphase.model.attention_context import AttentionContext
    from splitphase.model.layers import RMSNorm
    from splitphase.model.transformer import DecoderLayer, Transformer

PHASES = ("prefill", "decode")


def _env_phases() -> set[str]:
    value = os.environ.get("SPLITPHASE_COMPILE", "0").strip().lower()
    if value in ("1", "on", "true", "all"):
        return set(PHASES)
    return {p for p in PHASES if p in value.split(",")}


_SWITCHES = PhaseSwitches("compile phases", {p: p in _env_phases() for p in PHASES})
# Whether a phase's compiled pieces call the native kernels (as opaque ops) or the torch
# reference, which inductor then fuses; measured (bench/compile_ab.py, README): in prefill
# inductor's fused torch path ran 1-2% faster than the native element-wise passes; in decode
# the pieces took 1.12x / 1.13x eager's time at b1 / b8 with the skinny kernel, 1.21x / 2.0x
# with torch's matrix-vector product.
_NATIVE_IN_GRAPH = PhaseSwitches("compile phases", {"prefill": False, "decode": True})


def set_enabled(on: bool, phases: Iterable[str] = PHASES) -> None:
    """Compile (or not) the given phases' passes for this process."""
    _SWITCHES.set(on, phases)


def switched(on: bool, phases: Iterable[str] = PHASES) -> contextlib.AbstractContextManager[None]:
    """The given phases compiled (or not) inside the block, as they were after it."""
    return _SWITCHES.switched(on, phases)


def is_enabled(phase: str) -> bool:
    """True when this phase's passes run compiled."""
    return _SWITCHES.is_on(phase)


def enabled_phases() -> list[str]:
    """The phases compiled now, in PHASES order."""
    return _SWITCHES.names_on()


def native_in_graph(on: bool, phases: Iterable[str] = PHASES
                    ) -> contextlib.AbstractContextManager[None]:
    """Inside the block these phases' compiled pieces call the native kernels (on) or the
    torch reference that inductor fuses (off); benchmarks compare the two."""
    return _NATIVE_IN_GRAPH.switched(on, phases)


def phase_of(ids: torch.Tensor, ctx: AttentionContext) -> str:
    """"decode" when the pass feeds one token per sequence (the reference cache's (B, 1), or
    an engine step of decodes only), else "prefill"."""
    if ids.shape[1] == 1:
        return "decode"
    plan_of = getattr(ctx, "decode_plan", None)
    return "decode" if plan_of is not None and plan_of() is not None else "prefill"


def wanted(model: Transformer, ids: torch.Tensor, ctx: AttentionContext) -> str | None:
    """The phase whose compiled pieces this pass of `model` should run, or None (eager)."""
    if not _SWITCHES.names_on() or torch.is_grad_enabled():
        return None
    if model.cfg.is_moe or model.has_aux_flow or len(model.layers) == 0:
        return None
    phase = phase_of(ids, ctx)
    return phase if is_enabled(phase) else None


def _first(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first layer's norm and rotated q (B, T, H, D), k, v (B, T, G, D)."""
    return layer.self_attn.project_qkv(layer.input_layernorm(x), cos, sin)


def _between(
    layer: DecoderLayer, nxt: DecoderLayer, x: torch.Tensor, a: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From layer's attention output a (B, T, H*D) to nxt's q, k, v: the residual x after
    layer, and nxt's rotated projections."""
    x, h2 = layer.post_attention_layernorm.residual(x, layer.self_attn.o_proj(a))
    x, h = nxt.input_layernorm.residual(x, layer.mlp(h2))
    return (x, *nxt.self_attn.project_qkv(h, cos, sin))


def _last(layer: DecoderLayer, norm: RMSNorm, x: torch.Tensor, a: torch.Tensor
          ) -> torch.Tensor:
    """From the last attention output a (B, T, H*D) to the final-normed hidden states."""
    x, h2 = layer.post_attention_layernorm.residual(x, layer.self_attn.o_proj(a))
    return norm.residual(x, layer.mlp(h2))[1]


class _Pieces:
    """The compiled pieces, built on first use (torch.compile itself is lazy, but building
    them at import would pull inductor into every process)."""

    def __init__(self) -> None:
        self._fns: dict[str, Callable[..., Any]] = {}

    def get(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name not in self._fns:
            self._fns[name] = torch.compile(fn, dynamic=True)
        return self._fns[name]

    def reset(self) -> None:
        """Forget the compiled graphs (tests; a new model shape costs recompiles anyway)."""
        self._fns.clear()
        torch._dynamo.reset()


PIECES = _Pieces()


def _piece(phase: str, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    compiled = PIECES.get(name, fn)
    if _NATIVE_IN_GRAPH.is_on(phase):
        return compiled(*args)
    with skinny.switched(False):  # traced (and guarded) with the torch path
        return compiled(*args)


def run_layers(
    model: Transformer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ctx: AttentionContext, phase: str,
) -> torch.Tensor:
    """Final-normed hidden states (B, T, D) of embeddings x through every layer: compiled
    dense pieces (as `phase` runs them), eager attention in ctx between them."""
    layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
    q, k, v = _piece(phase, "first", _first, layers[0], x, cos, sin)
    for i, layer in enumerate(layers):
        a = ctx.attend(layer.layer_idx, layer.self_attn, q, k, v)  # (B, T, H*D)
        if i + 1 == len(layers):
            break
        x, q, k, v = _piece(phase, "between", _between, layer, layers[i + 1], x, a, cos, sin)
    return _piece(phase, "last", _last, layers[-1], model.norm, x, a)
