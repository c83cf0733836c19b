"""What a person or a program reads: the CLI, summaries, plots, the Perfetto trace, reports, warnings, and output files."""
