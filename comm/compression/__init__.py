"""commopt.comm.compression: gradient compressors with error feedback."""
