"""Model runners: execute a scheduler plan (``torch`` computes it, ``sim`` models its duration)."""
