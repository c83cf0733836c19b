"""From an op DAG to results: collective lowering, compute lookup, the compiler and event engine, results, the memory ledger, the math path, and `run`."""
