"""splitphase: phase-aware LLM inference (prefill and decode treated as the two machines they are)."""

__version__ = "0.1.0"
