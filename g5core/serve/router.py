"""Routers: which instance of a pool a request goes to. Each is a :class:`g5core.Router`,
``choose(request, instances) -> index``; instances expose their scheduler
(:class:`g5core.RoutedInstance`: ``instance.scheduler``, ``outstanding_tokens()``,
``used_blocks``, ``total_blocks``). Ties go to the lowest index, so a run is deterministic."""
from __future__ import annotations


class RoundRobin:
    """Instances in turn."""

    def __init__(self):
        self.next = 0

    def choose(self, request, instances) -> int:
        i = self.next % len(instances)
        self.next += 1
        return i


class LeastOutstandingTokens:
    """The instance with the fewest tokens still to compute (prompts left and outputs left)."""

    def choose(self, request, instances) -> int:
        return min(range(len(instances)), key=lambda i: (instances[i].scheduler.outstanding_tokens(), i))


class LeastKvUse:
    """The instance whose KV pool is least used (share of blocks), then the fewest waiting."""

    def choose(self, request, instances) -> int:
        def load(i):
            s = instances[i].scheduler
            return (s.used_blocks / s.total_blocks, len(s.waiting), i)
        return min(range(len(instances)), key=load)


BUILTIN_ROUTERS = {
    "round_robin": RoundRobin,
    "least_outstanding_tokens": LeastOutstandingTokens,
    "least_kv": LeastKvUse,
}
