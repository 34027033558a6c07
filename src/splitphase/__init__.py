"""splitphase: phase-aware LLM inference; prefill and decode treated as two different machines."""

__version__ = "0.1.0"
