"""Engine configuration: batching policy, batch limits and the KV cache budget."""

from __future__ import annotations

from dataclasses import dataclass

from splitphase.errors import UserError

ENGINE_POLICIES = ("mixed", "chunked", "disaggregated")
COMPILE_PHASES = ("prefill", "decode")  # splitphase.model.compiled.PHASES, without torch
# What the paged pool stores K/V in: "auto" is the model's dtype (vLLM's --kv-cache-dtype);
# "fp8" is fp8_e4m3, as in vLLM. Bytes per element, so the audit and the simulator can price a
# pool without torch.
KV_CACHE_DTYPE_BYTES = {
    "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_BYTES)


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per stored K or V element ("auto": the model's own width)."""
    if kv_cache_dtype == "auto":
        return model_dtype_bytes
    if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise UserError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPE_BYTES[kv_cache_dtype]


@dataclass(frozen=True)
class EngineConfig:
    """How one engine batches and how much memory its KV cache gets."""

    policy: str = "chunked"
    role: str | None = None  # "prefill" | "decode": one worker of a disaggregated pair
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None  # explicit budget; else kv_memory_fraction of free memory
    kv_memory_fraction: float = 0.25
    num_blocks: int | None = None  # overrides the byte budget (tests)
    max_model_len: int | None = None  # longest prompt + output; None: what model and pool allow
    seed: int = 0
    # Phases whose model passes run through torch.compile (process-wide once the engine is
    # built; splitphase.model.compiled): (), ("prefill",), ("decode",) or both.
    compile: tuple[str, ...] = ()
    # K/V pool dtype (KV_CACHE_DTYPES): bfloat16 under an fp32 model halves the pool's bytes,
    # so twice the tokens fit and decode reads half the K/V; fp8 quarters them (unscaled, as
    # vLLM's fp8 cache without calibrated scales). Attention still runs in fp32.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "compile", tuple(self.compile))  # a list from JSON or kwargs
        bad = [p for p in self.compile if p not in COMPILE_PHASES]
        if bad:
            raise UserError(f"compile phases must be among {COMPILE_PHASES}, got {bad}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.policy not in ENGINE_POLICIES:
            raise UserError(f"policy must be one of {ENGINE_POLICIES}, got {self.policy!r}")
        if (self.policy == "disaggregated") != (self.role in ("prefill", "decode")):
            raise UserError(
                "policy 'disaggregated' runs a prefill and a decode worker: set role to 'prefill'"
                f" or 'decode' for each worker's engine (got policy={self.policy!r}, "
                f"role={self.role!r}); use splitphase.engine.disagg for the pair"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise UserError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                            f"max_num_seqs ({self.max_num_seqs}): every running sequence "
                            "decodes in the same step")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise UserError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise UserError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise UserError(f"max_model_len must be >= 1, got {self.max_model_len}")

    def resolve_max_model_len(self, model_max_len: int, pool_tokens: int) -> int:
        """The longest request this engine serves: max_model_len where given (refused, as by
        vLLM, when the model, the pool or mixed's step budget cannot hold it), else the least
        of those limits."""
        limits = {"the model's max_seq_len": model_max_len, "the K/V pool's tokens": pool_tokens}
        if self.policy == "mixed":  # it prefills every prompt whole, in one step
            limits["max_num_batched_tokens (the mixed policy prefills whole)"] = (
                self.max_num_batched_tokens)
        if self.max_model_len is None:
            return min(limits.values())
        over = {k: v for k, v in limits.items() if v < self.max_model_len}
        if over:
            what, most = min(over.items(), key=lambda kv: kv[1])
            fix = "lower it, or grow the pool (--kv-cache-bytes)" if "pool" in what else "lower it"
            raise UserError(f"max_model_len {self.max_model_len} is more than {what}, {most}: "
                            f"{fix}")
        return self.max_model_len
