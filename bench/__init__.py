"""commopt.bench: benchmarks, the emulated cluster, models and plots (``commopt-bench``).

Nothing in commopt imports this package (docs/architecture.md section 1).
"""
