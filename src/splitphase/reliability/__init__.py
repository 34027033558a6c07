"""Reliability tooling: open-loop load with byte-level stream checks, server probes, the ledger."""
