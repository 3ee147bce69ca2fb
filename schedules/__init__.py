"""commopt.schedules: overlap schedulers and the iteration simulator."""
