"""Phase-limit measurement: peaks, our decode/prefill, and the baselines, side by side."""
