"""Which form of a prefill-shaped linear runs fastest on this machine, timed on first use.

A packed GEMM is not fastest at every row count. On the Intel AMX host (`bench/gemm_forms.py
--dtype bfloat16`, base-125m, two threads) oneDNN's bf16 GEMM on a packed weight ran the two
linears with 768 outputs (O, down) at 1,060-1,360 GFLOP/s from 448 to 1,024 rows (down from
512), against 1,470-2,370 at 256-384 rows and at 1,536-2,048; torch's linear (oneDNN's matmul
on the plain weight) ran them at 1,570-2,030 from 448 to 640 rows but 990-1,300 at 768-1,024,
where the packed GEMM over pieces of 256 rows ran 1,280-1,740; the wider shapes kept the packed
GEMM ahead at every row count. Which form wins depends on the CPU, the library version, the
shape and the rows, so it is measured, not tabled: the first call of each (dtype, weight shapes,
row bucket, threads) times every form on its own input, alternating, and the process keeps the
fastest for that key (products under `MIN_TIMED_FLOPS`, and calls under a torch dispatch mode
such as the FLOP counter, keep the packed GEMM untimed). A bf16
prefill of 512 tokens took 0.90x the time it took with the packed GEMM throughout, 2,048 tokens
0.97x, 128 tokens the same (`bench/prefill_ab.py --variants model form-packed`); fp32 kept
the packed GEMM (MKL's) at every shape.

Forms:
- "packed": the packed GEMM, the default; another form replaces it only when clearly faster
  (under `MARGIN` of its time), so timing noise cannot move a shape off it;
- "split": the packed GEMM over equal row pieces of at most `SPLIT_ROWS` (rows above that);
- "torch": torch's linear on the plain weights, which the caller runs (`run` returns None).

`SPLITPHASE_GEMM_FORM` (`auto`, the default, or a form's name) forces one for the process;
`forced` does inside a block (benchmarks, the peak measurement).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from splitphase.errors import UserError

PackedRun = Callable[[torch.Tensor], torch.Tensor]  # x (..., K) -> x @ W.T on the packed copy

FORMS = ("packed", "split", "torch")
SPLIT_ROWS = 256  # the row count the AMX host's slow band starts above (see the docstring)
MARGIN = 0.9  # another form replaces "packed" only under this share of its time
ROUNDS = 3  # each form timed this many times, alternating; best of each
# Smaller products keep "packed" untimed: their timings (tens of microseconds) are mostly noise,
# and a tiny model's results then do not depend on which form a noisy probe took.
MIN_TIMED_FLOPS = 5e7

_ENV = os.environ.get("SPLITPHASE_GEMM_FORM", "auto").lower()
if _ENV not in ("auto", *FORMS):
    raise UserError(f"SPLITPHASE_GEMM_FORM must be auto or one of {', '.join(FORMS)}, got {_ENV!r}")
_forced: str | None = None if _ENV == "auto" else _ENV


class _Key(NamedTuple):
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]  # the weights', (out, in) each
    rows: int  # the bucket
    threads: int


_chosen: dict[_Key, str] = {}


def bucket(rows: int) -> int:
    """The row count a choice is keyed on: exact up to 64 (decode batches), then rounded up
    to a multiple of 64 up to 2,048 (the slow bands above were a few hundred rows wide), then
    to a power of two."""
    if rows <= 64:
        return rows
    if rows <= 2048:
        return -(-rows // 64) * 64
    return 1 << (rows - 1).bit_length()


def _packed(x: torch.Tensor, ws: Sequence[torch.Tensor], packed: PackedRun) -> torch.Tensor:
    return packed(x)


def _split(x: torch.Tensor, ws: Sequence[torch.Tensor], packed: PackedRun) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    pieces = -(-flat.shape[0] // SPLIT_ROWS)
    size = -(-flat.shape[0] // pieces)  # equal pieces: no short remainder at a slow size
    out = torch.cat([packed(flat[i : i + size]) for i in range(0, flat.shape[0], size)])
    return out.unflatten(0, x.shape[:-1])


def _torch(x: torch.Tensor, ws: Sequence[torch.Tensor], packed: PackedRun) -> torch.Tensor:
    return torch.cat([F.linear(x, w) for w in ws], dim=-1)


_RUN: dict[str, Callable[[torch.Tensor, Sequence[torch.Tensor], PackedRun], torch.Tensor]] = {
    "packed": _packed, "split": _split, "torch": _torch,
}


def candidates(rows: int) -> list[str]:
    """The forms that apply at this many rows ("split" only above `SPLIT_ROWS`)."""
    return [f for f in FORMS if f != "split" or rows > SPLIT_ROWS]


def pick(seconds: dict[str, float]) -> str:
    """The fastest form, unless it is not clearly faster than "packed" (`MARGIN`)."""
    fastest = min(seconds, key=seconds.__getitem__)
    if fastest != "packed" and seconds[fastest] >= MARGIN * seconds["packed"]:
        return "packed"
    return fastest


def _probe(
    x: torch.Tensor, ws: Sequence[torch.Tensor], packed: PackedRun, names: list[str]
) -> tuple[str, torch.Tensor]:
    """(the form `pick` takes, its product of x) after timing each ROUNDS times, alternating."""
    best = dict.fromkeys(names, math.inf)
    outs: dict[str, torch.Tensor] = {}
    for _ in range(ROUNDS):
        for name in names:
            t0 = time.perf_counter()
            outs[name] = _RUN[name](x, ws, packed)
            best[name] = min(best[name], time.perf_counter() - t0)
    name = pick(best)
    return name, outs[name]


def _untimed(x: torch.Tensor, ws: Sequence[torch.Tensor]) -> bool:
    return 2 * x.numel() * sum(w.shape[0] for w in ws) < MIN_TIMED_FLOPS


def run(x: torch.Tensor, ws: Sequence[torch.Tensor], packed: PackedRun) -> torch.Tensor | None:
    """x @ cat(ws).T in this key's fastest form, None where that is torch's linear (the caller
    runs it on the plain weights, as when nothing is packed)."""
    rows = x.numel() // x.shape[-1]
    name = _forced
    if name is None and (_untimed(x, ws) or is_in_torch_dispatch_mode()):
        name = "packed"  # under a dispatch mode (a FLOP counter) the probe's runs would count
    if name is None:
        key = _Key(x.dtype, tuple(tuple(w.shape) for w in ws), bucket(rows),
                   torch.get_num_threads())
        name = _chosen.get(key)
        if name is None:
            name, out = _probe(x, ws, packed, candidates(rows))
            _chosen[key] = name
            return None if name == "torch" else out
    if name == "torch":
        return None
    return _RUN[name if name in candidates(rows) else "packed"](x, ws, packed)


def chosen() -> dict[str, str]:
    """The choices made so far, readable: "bfloat16 768x3072 @512 rows, 2 threads" -> form."""
    out = {}
    for key, name in _chosen.items():
        dims = "+".join("x".join(map(str, shape)) for shape in key.shapes)
        dtype = str(key.dtype).removeprefix("torch.")
        out[f"{dtype} {dims} @{key.rows} rows, {key.threads} threads"] = name
    return out


def reset() -> None:
    """Forget the choices: the next call of each key times the forms again."""
    _chosen.clear()


@contextlib.contextmanager
def forced(name: str | None) -> Iterator[None]:
    """Every call takes form `name` inside the block (None: the timed choice), as before after."""
    global _forced
    if name is not None and name not in FORMS:
        raise UserError(f"no GEMM form {name!r}; choose one of {', '.join(FORMS)}")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before
