"""commopt.comm: topology, the comm engine, collectives, compression, hooks, in-network aggregation."""
