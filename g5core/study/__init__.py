"""Many runs: sweeps, the layout search, validation and calibration, and the results database."""
