"""From the op DAG to results: compute lookup, the compiler and event engine, conservation and reports, the memory ledger."""
