"""The router's Prometheus metrics: what a pool's clients experience, and how often the router repaired it.

One registry per router (not the global one), so tests can run several routers in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvfleet_router_requests_total", "Requests received, by endpoint", ["endpoint"],
                                registry=self.registry)
        self.errors = Counter("kvfleet_router_errors_total", "Requests answered with an error, by HTTP status", ["status"],
                              registry=self.registry)
        self.placements = Counter("kvfleet_router_placements_total", "Placements, by the rule that chose the worker",
                                  ["rule"], registry=self.registry)
        self.resumes = Counter("kvfleet_router_resumes_total",
                               "Requests resumed on another worker by token re-prefill after their worker failed",
                               registry=self.registry)
        self.migrations = Counter("kvfleet_router_migrations_followed_total",
                                  "Streams followed from a migration's source to its target", registry=self.registry)
        self.prefix_matched_tokens = Counter(
            "kvfleet_router_prefix_matched_tokens_total",
            "Prompt tokens the prompt tree said the chosen worker caches (MemServe's global prompt tree)",
            registry=self.registry)
        self.held = Gauge("kvfleet_router_held_requests",
                          "Requests held while the pool has no Ready worker (scale from zero)", registry=self.registry)
        self.held_outcomes = Counter("kvfleet_router_hold_outcomes_total",
                                     "Requests that met the hold queue, by outcome: released, full, timeout, gone",
                                     ["outcome"], registry=self.registry)
        self.in_flight = Gauge("kvfleet_router_requests_in_flight", "Requests being relayed", registry=self.registry)
        self.time_to_second_token = Histogram(
            "kvfleet_router_time_to_second_token_seconds",
            "From the request's arrival to its second text (after a disaggregated pool's hand-over)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)
        self.time_to_first_token = Histogram(
            "kvfleet_router_time_to_first_token_seconds", "From the request's arrival to its first text",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)
