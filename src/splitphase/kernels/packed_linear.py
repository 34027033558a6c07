"""Prefill-shaped linears (and decode steps past the skinny kernel's rows) on pre-packed weights
(MKL's or oneDNN's packed GEMM), or torch.

torch's fp32 linear calls MKL's sgemm, which repacks the weight into its blocked layout on
every call: for a 512-token prefill of base-125m that is 10-12% of each GEMM (one thread,
best of 15: 14.0 -> 12.6 ms for 512x3072 @ 3072x768). `torch.ops.mkl._mkl_reorder_linear_weight`
packs a weight once (`cblas_sgemm_pack`) and `_mkl_linear` multiplies by the packed copy
(`cblas_sgemm_compute`): the same MKL microkernel, so the result equals `F.linear` within fp32
rounding (bit-identical at most shapes; where MKL's unpacked path blocks K differently, one
ulp apart, as torch's own results differ between row counts). One packed copy serves every
row count, not only the one it was packed at (tests/kernels/test_packed_linear.py checks it).

The cost is memory: MKL allocates ~2.2x the weight (fp32) for a packed copy, of which about
half is touched (base-125m fp32: 396 MiB of linear weights, 1060 MiB allocated for their packed
copies and the Q/K/V stack, 457 MiB more resident), kept next to the weight that decode's
skinny kernel reads. Packing is lazy (the first prefill-shaped call per weight), so a model
that only trains or decodes never pays it. `SPLITPHASE_PACKED_PREFILL` says how much: `auto`
(the default) packs while all packed copies together, counted as allocated, take at most
`packed_budget.AUTO_MEMORY_FRACTION` of the memory available when the first is made
(base-125m fp32: under 5% of this 24 GiB machine; a model too big for the budget keeps torch's
linear for the weights past it); `1`/`on` packs every weight; `0`/`off` none. On the 2-core
machine, quiet, `bench/prefill_ab.py` measured packed prefills at 0.906x and 0.927x the time
of torch's linear at 512 and 2048 tokens, and in a later run torch's linear (`--variants model
unpacked`) at 1.083x and 1.020x the packed time (once element-wise passes and attention ran on
torch's OpenMP team; before that, 1.046x and 0.98x, not worth the memory).

Which packed GEMM depends on the CPU, so a process picks one (`backend()`): MKL's is as fast as
it gets on the Intel hosts it was measured on, where oneDNN's (`mkldnn._reorder_linear_weight`
/ `_linear_pointwise`) was no faster; on an AMD Zen 5 host MKL runs its AVX2 code while oneDNN
uses AVX-512 (`bench/packed_gemm.py`: 2 threads, base-125m's shapes at 64-2048 rows, oneDNN
358-506 GFLOP/s against MKL's 138-220; its packed copy is also the weight's size, not ~2.2x),
and on an AMD Zen 4 host oneDNN is still 10-70% faster (at 32-512 rows 208-220 GFLOP/s against
MKL's 121-195). `SPLITPHASE_PACKED_GEMM` says which: `auto` (the default) times one GEMM each
way on first use (`PROBE_ROUNDS` turns) and keeps the one the CPU favours (MKL's on Intel or
without AVX-512, else oneDNN's) unless the other is clearly faster (`PROBE_MARGIN`); `mkl` or
`onednn` forces one. oneDNN's result equals `F.linear` within fp32 rounding, not bit for bit (a
different microkernel). bf16 linears pack with oneDNN's whatever fp32 took (MKL's has
no bf16): on the AMD host, 2 threads, 512-2048 rows, 0-7% faster than torch's linear at every
shape, the results bit-identical. Where oneDNN has no bf16 (no AVX-512) or only an emulated
one (no bf16 instructions: `packed_gemms.takes`) they widen to fp32's.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from splitphase.errors import UserError
from splitphase.hardware.cpuinfo import cpu_has_avx512, cpu_vendor
from splitphase.kernels import amx, gemm_choice, packed_budget, packed_gemms
from splitphase.kernels.packed_gemms import GEMMS, HAVE
from splitphase.kernels.switch import Switch, switch_functions

# Below this many rows a linear is decode-shaped: the skinny kernel (or plain torch) serves it
# and the packing would not pay for its memory.
MIN_ROWS = 32

# oneDNN's packed GEMM takes over from the skinny kernel from this many rows (fp32 and bf16).
# On the AMD host (2 threads, base-125m) it beat the kernel by far past 8 rows
# (bench/skinny_rows.py, the MLP linears alone: fp32 0.94x the kernel's time at 8 rows, 0.73x
# at 16, 0.68x at 32; bf16 0.80x at 16). A whole decode step with its linears on the packed
# copies inside the native pass, against the kernel's, won from 4 rows (oneDNN forced from 2
# rows, a script outside the repo: fp32 1.06-1.16x the time at 3 rows, 0.94-0.98x at 4; bf16
# 0.98-1.12x at 3, 0.95-0.97x at 4); `bench/decode_ab.py --blocks --variants kernel_max fused`
# at context 256: fp32 0.977x at 5 rows, 0.961x at 8, 0.731x at 32; bf16 0.966x, 0.924x,
# 0.761x. MKL's (Intel) keeps MIN_ROWS: there the kernel was level with MKL's GEMM at 48 rows.
ONEDNN_MIN_ROWS = 5

# bf16 on a CPU with AMX tiles: oneDNN multiplies on them at about one cost from 1 to 16 rows,
# and the skinny kernel keeps bf16 up to its own rows (`skinny.own_rows`: 32 on its AMX tiles,
# else 8). On the Intel AMX host (`bench/decode_ab.py --blocks --batch 4 5 6 8 --variants fused
# kernel_max --dtypes bfloat16`, context 512, before the kernel had tiles) a step with the
# kernel took 0.747x the hand-over's time at 5 rows, 0.805x at 6, 0.958x at 8.
AMX_BF16_MIN_ROWS = 33


_MODE = os.environ.get("SPLITPHASE_PACKED_PREFILL", "auto").lower()
if _MODE not in ("auto", "1", "on", "0", "off"):
    raise UserError(f"SPLITPHASE_PACKED_PREFILL must be auto, on or off, got {_MODE!r}")
_SWITCH = Switch(on=_MODE != "0" and _MODE != "off")

_BUDGET = packed_budget.Budget(limited=_MODE == "auto")


# Under `auto`, the probe must find the other backend clearly faster to leave the one this
# CPU's vendor favours: MKL's on Intel, where it runs its AVX-512 code; oneDNN's elsewhere, where
# MKL runs its AVX2 code. On the Intel host, with one timing each and a margin of 0.9, a slow
# spell in MKL's turn picked oneDNN in one process of six (its best 1.96 ms against 1.76; the
# next pair 1.85 and 1.64), and with it decode's early hand-over: a batch-8 fp32 step 33.1 ms
# against 26.2. On the AMD Zen 5 host oneDNN took 0.4x MKL's time; on the AMD Zen 4 host
# (AVX-512 on 256-bit units, so MKL's AVX2 code comes closer) 0.84-0.85x in three processes,
# where MKL's prefill of 512 tokens reached 79% of the fp32 peak against oneDNN's 92%, and
# the engine at 32 concurrent requests 4.8x its one-request rate against 6.6x
# (bench/phase_limits.py, each forced with SPLITPHASE_PACKED_GEMM). On the AVX2-only AMD Zen 3
# host, where neither has AVX-512 code to run, MKL's was the faster (`bench/packed_gemm.py`,
# base-125m's shapes: 132-177 GFLOP/s at 512 and 2048 rows against oneDNN's 81-148): off Intel
# MKL is favoured too where the CPU lacks AVX-512.
PROBE_MARGIN = 0.75
PROBE_ROUNDS = 3  # each backend timed this many times, alternating; best of each
PROBE_SHAPE = (256, 1024, 1024)  # rows, in, out: ~0.5 GFLOP, a few ms a call

_GEMM_ENV = os.environ.get("SPLITPHASE_PACKED_GEMM", "auto").lower()
if _GEMM_ENV not in ("auto", *GEMMS):
    raise UserError(f"SPLITPHASE_PACKED_GEMM must be auto, mkl or onednn, got {_GEMM_ENV!r}")
_chosen: str | None = None if _GEMM_ENV == "auto" else _GEMM_ENV

if _chosen is not None and _chosen not in HAVE:
    raise UserError(f"SPLITPHASE_PACKED_GEMM={_chosen}: this torch has no such packed GEMM")


def backends() -> list[str]:
    """The packed GEMMs this torch has, by name ("mkl", "onednn")."""
    return list(HAVE)


def _probe_s(name: str) -> float:
    """The probe GEMM's best seconds over 5 timed calls on a packed weight, after a warm-up."""
    rows, in_f, out_f = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g)
    gemm = GEMMS[name]
    best = math.inf
    with torch.no_grad():
        packed = gemm.pack(w)
        for i in range(6):
            t0 = time.perf_counter()
            gemm.run(x, packed, w, rows)
            if i:
                best = min(best, time.perf_counter() - t0)
    return best


def _probe_all(names: list[str]) -> dict[str, float]:
    """Each backend's best probe time over PROBE_ROUNDS turns, alternating, so a slow spell
    hits them alike."""
    best = dict.fromkeys(names, math.inf)
    for _ in range(PROBE_ROUNDS):
        for name in names:
            best[name] = min(best[name], _probe_s(name))
    return best


def favoured(vendor: str, avx512: bool = True) -> str:
    """The backend `auto` keeps unless the other is clearly faster: MKL's on an Intel CPU and
    on any CPU without AVX-512 (there both run AVX2 code), oneDNN's elsewhere."""
    return "mkl" if vendor == "GenuineIntel" or not avx512 else "onednn"


def pick(seconds: dict[str, float], vendor: str = "GenuineIntel", avx512: bool = True) -> str:
    """The backend `auto` takes given each one's probe time: the one `favoured` for this
    CPU unless the other's is clearly faster, the only one where one is missing."""
    if "mkl" in seconds and "onednn" in seconds:
        keep = favoured(vendor, avx512)
        other = "onednn" if keep == "mkl" else "mkl"
        return other if seconds[other] < PROBE_MARGIN * seconds[keep] else keep
    return next(iter(seconds))


def backend() -> str | None:
    """The packed GEMM this process uses (None where this torch has none): the one
    SPLITPHASE_PACKED_GEMM names, else the probe's pick, made once at the first call."""
    global _chosen
    if _chosen is None:
        have = backends()
        _chosen = pick(_probe_all(have), cpu_vendor(), cpu_has_avx512()) if have else None
    return _chosen


def backend_for(dtype: torch.dtype) -> str | None:
    """The packed GEMM for linears in `dtype`: `backend()` for fp32, oneDNN's for bf16 (the
    only one with bf16, whatever fp32 took); None where this torch has none for it."""
    if dtype == torch.float32:
        return backend()
    return next((n for n in HAVE if packed_gemms.takes(n, dtype)), None)


def widened_backend(dtype: torch.dtype) -> str | None:
    """The fp32 packed GEMM that multiplies `dtype` widened to fp32, where no packed GEMM takes
    it as it is (bf16 on a CPU without AVX-512: torch's bf16 linear then has only its own GEMM,
    at a ninth of the fp32 rate on the AVX2-only Zen 3 host; or without bf16 instructions, where
    oneDNN's runs emulated at a fifth); None elsewhere. The products of
    bf16 values are exact in fp32 and the sums fp32, as in torch's bf16 linear; the output
    rounds to bf16 once."""
    if dtype != torch.bfloat16 or backend_for(dtype) is not None:
        return None
    return backend()


def gemm_plan(dtype: torch.dtype) -> tuple[str, bool] | None:
    """(backend, widened to fp32) for a prefill linear in `dtype`; None where none applies."""
    name = backend_for(dtype)
    if name is not None:
        return name, False
    wide = widened_backend(dtype)
    return (wide, True) if wide is not None else None


def min_rows(dtype: torch.dtype) -> int:
    """Rows from which a linear in `dtype` takes the packed GEMM (when one is usable)."""
    if backend_for(dtype) != "onednn":
        return MIN_ROWS
    if dtype == torch.bfloat16 and amx.AMX_TILES:
        return max(ONEDNN_MIN_ROWS, AMX_BF16_MIN_ROWS)
    return ONEDNN_MIN_ROWS


def set_backend(name: str | None) -> None:
    """Use `name` for packing from now on (None: probe again at the next use)."""
    global _chosen
    if name is not None and name not in HAVE:
        raise UserError(f"this torch has no {name} packed GEMM")
    _chosen = name


@contextlib.contextmanager
def using_backend(name: str) -> Iterator[None]:
    """Pack with `name` inside the block, as before after it."""
    before = _chosen
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)


def mode() -> str:
    """How prefill linears pack now: "auto" (within the memory budget), "on" (all), "off"."""
    if not is_enabled():
        return "off"
    return "auto" if _BUDGET.limited else "on"


def available() -> bool:
    """True when this torch has a packed GEMM (whether or not it is switched on)."""
    return bool(HAVE)


set_enabled, switched, is_enabled = switch_functions(
    _SWITCH, requires=available, module=__name__,
    set_doc="Turn packed prefill linears on or off for this process (torch's linear when off).",
    switched_doc="Packed prefill linears on (or off) inside the block, as they were after it.",
    enabled_doc="True when packed prefill linears are on and this torch has a packed GEMM.",
)


class PackedWeight:
    """The packed copy of one weight, or of several stacked (Q/K/V: one GEMM for the three),
    rebuilt when any of them changes.

    The key is the backend, the weight's storage address, version counter (bumped by every
    in-place write: `load_state_dict`, an optimizer step) and thread count (MKL packs for the
    threads it will compute with), so a stale copy is never used. Copies and pickles start
    empty: the packed tensor is an MKL handle or a oneDNN tensor, never saved.
    """

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._refused: tuple[object, ...] | None = None  # the key the budget said no to
        self._packed: torch.Tensor | None = None
        self._plain: torch.Tensor | None = None  # what was packed, (sum N, K), where kept
        self._bytes = 0  # counted against the budget: the packed copy and any stack made for it

    def get(
        self, ws: Sequence[torch.Tensor], name: str, widen: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(packed copy, plain stack or None) of ws on dim 0 for backend `name` (widened to
        fp32 first: `widened_backend`), rebuilt if any changed since last call; None where the
        memory budget has no room for them (the caller uses torch's linear).

        `_mkl_linear` takes the plain weight too (its fallback when the row count differs
        from the packing's), so for MKL a stack of several is kept: never a stand-in that
        would be silently wrong if that fallback ran. oneDNN's op takes the packed copy alone.
        """
        weights = (v for w in ws for v in (w.data_ptr(), w._version))
        key = (name, widen, torch.get_num_threads(), *weights)
        if key == self._refused:
            return None
        if self._packed is None or key != self._key:
            self._drop()  # the old copies go before new ones are built
            gemm = GEMMS[name]
            stacked = ws[0] if len(ws) == 1 else torch.cat(list(ws))
            stacked = stacked.float() if widen else stacked
            packed = gemm.pack(stacked)
            plain = stacked if gemm.needs_plain else None
            # a stack (or fp32 copy) kept only for MKL's fallback
            extra = plain is not None and (len(ws) > 1 or widen)
            nbytes = packed_budget.nbytes(packed) + (packed_budget.nbytes(stacked) if extra else 0)
            if not _BUDGET.admit(nbytes):
                self._refused = key
                return None
            self._packed, self._plain, self._key, self._bytes = packed, plain, key, nbytes
        return self._packed, self._plain

    @property
    def nbytes(self) -> int:
        """Bytes this packed copy (and its stack) hold; 0 before the first prefill-shaped call."""
        return self._bytes

    def _drop(self) -> None:
        if self._bytes:
            _BUDGET.release(self._bytes)
        self._packed = self._plain = None
        self._bytes = 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have cleared globals
            self._drop()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedWeight:
        return PackedWeight()


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when x @ w.T can take a packed GEMM: on CPU, in a dtype one has (fp32; bf16 on
    oneDNN's, or widened to fp32 where that has none), at least `min_rows` rows, no autograd."""
    if torch.compiler.is_compiling():
        # The packed copy is a Python-side cache keyed on data_ptr, which dynamo cannot trace;
        # calling it through a graph break (torch.compiler.disable) made dynamo compile every
        # frame on the way separately, one graph per weight shape, past its recompile limit.
        return False
    if not is_enabled():  # before the row check: no guard on rows for a path that is off
        return False
    if x.dtype != w.dtype or x.device.type != "cpu":
        return False
    fewest = min(ONEDNN_MIN_ROWS, MIN_ROWS)  # the exact bound (`min_rows`) needs the backend
    if x.dim() == 0 or x.shape[-1] != w.shape[1] or x.numel() < fewest * x.shape[-1]:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False  # the packed ops have no backward: training keeps torch's linear
    # An inference tensor (a weight made under inference_mode) has no version counter to key
    # its packed copy on, so an in-place change could not be noticed.
    if w.dim() != 2 or not w.is_contiguous() or w.is_inference():
        return False
    return gemm_plan(x.dtype) is not None and x.numel() >= min_rows(x.dtype) * x.shape[-1]


def linear(x: torch.Tensor, w: torch.Tensor, pack: PackedWeight) -> torch.Tensor | None:
    """x @ w.T (..., N) on w's packed copy, or None where `usable` says no (caller uses torch)."""
    return stacked_linear(x, [w], pack)


def stacked_linear(
    x: torch.Tensor, ws: Sequence[torch.Tensor], pack: PackedWeight
) -> torch.Tensor | None:
    """x @ cat(ws).T (..., sum N): several linears sharing x as one GEMM on one packed copy
    (in the form `gemm_choice` found fastest for this shape and row count); None where `usable`
    says no for any of them, or where torch's linear is the faster form."""
    if not ws or not all(usable(x, w) for w in ws):
        return None
    plan = gemm_plan(x.dtype)
    got = pack.get(ws, *plan) if plan is not None else None  # `usable` said there is one
    if plan is None or got is None:
        return None
    packed, plain = got
    gemm, widen = GEMMS[plan[0]], plan[1]

    def on_packed(rows_x: torch.Tensor) -> torch.Tensor:
        rows = rows_x.numel() // rows_x.shape[-1]
        if widen:
            return gemm.run(rows_x.float(), packed, plain, rows).to(rows_x.dtype)
        return gemm.run(rows_x, packed, plain, rows)

    return gemm_choice.run(x, ws, on_packed)  # None: torch's linear is faster here
