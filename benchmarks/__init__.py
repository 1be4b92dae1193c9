"""Side-by-side benchmarks: each prints what it measured beside its baseline, as a ratio."""
