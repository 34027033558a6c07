"""Native decode kernels (built on first use with the machine's compiler; torch fallback)."""
