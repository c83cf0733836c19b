"""Request-level serving simulation (``g5 serve``): workloads, routers, per-instance
continuous-batching schedulers over a paged KV pool, prefill/decode disaggregation."""
