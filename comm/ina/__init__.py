"""commopt.comm.ina: simulated in-network aggregation (SwitchML/SHARP-style)."""
