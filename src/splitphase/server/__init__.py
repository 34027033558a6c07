"""OpenAI-compatible HTTP server: `splitphase serve` (see app.py for the routes)."""
