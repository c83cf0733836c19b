"""What the user gives: the configuration, models, systems, number formats, and the reading of input files with their limits."""
