"""The server's Prometheus metrics (``GET /metrics``): what its requests did, and the
runtime's own counts (tokens, pool, host memory, evictions) read when scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..actors import Reply
from ..runtime import Runtime, RuntimeStatistics
from ._sessions import Sessions

#: Seconds: from a few milliseconds (a warm turn on a GPU) to minutes (a long prefill).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _Snapshot(Collector):
    """The runtime's statistics as of the last scrape, with the sessions' counts."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions
        self.stats: RuntimeStatistics | None = None
        self.queued = 0

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        counters = {
            "prompt_tokens_prefilled": ("Prompt tokens run through the model.", s.prefill_tokens),
            "prompt_tokens_reused": (
                "History tokens reused from cache blocks instead of prefilled.",
                s.cached_tokens,
            ),
            "generated_tokens": ("Tokens generated.", s.generated_tokens),
            "turns": ("Turns finished by the engine.", s.turns),
            "evictions": ("Caches moved out of the pool to make room.", s.evictions),
            "restores": ("Caches brought back into the pool.", s.restores),
            "memory_restores": ("Of the restores, those from host memory.", s.memory_restores),
            "prefetches": ("Of the restores, those made ahead of the turn.", s.prefetches),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"mlx_actors_{name}", doc, value=value)
        pool = s.pool
        gauges = {
            "pool_blocks": ("Pool units in all.", pool.total_blocks),
            "pool_blocks_used": ("Pool units held by caches.", pool.used_blocks),
            "pool_blocks_reserved": ("Pool units promised to turns.", pool.reserved_blocks),
            "pool_blocks_kept": (
                "Pool units held by caches kept for agents' next turns.",
                pool.copy_blocks,
            ),
            "pool_bytes_used": ("Bytes of the pool held by caches.", pool.used_bytes),
            "host_bytes": (
                "Bytes of evicted caches and of copies of pool blocks kept in host memory.",
                s.host_bytes,
            ),
            "agents": ("Live agents (sessions included).", s.agents),
            "agents_resident": ("Agents whose cache is in the pool.", s.resident_agents),
            "agents_on_disk": ("Agents whose cache was moved out of the pool.", s.agents_on_disk),
            "turns_in_flight": ("Turns queued in the engine or running.", s.turns_in_flight),
            "queue_depth": ("Requests waiting in agents' mailboxes.", self.queued),
            "sessions": ("Sessions kept.", len(self._sessions)),
            "sessions_busy": ("Sessions handling a request.", self._sessions.busy),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"mlx_actors_{name}", doc, value=value)


class Metrics:
    """The server's metrics, in a registry of its own."""

    def __init__(self, runtime: Runtime, sessions: Sessions) -> None:
        self._rt = runtime
        self.registry = CollectorRegistry()
        self._snapshot = _Snapshot(sessions)
        self.registry.register(self._snapshot)
        r = self.registry
        self.requests = Counter(
            "mlx_actors_requests",
            "Requests answered, by API and status.",
            ["api", "status"],
            registry=r,
        )
        self.replies = Counter(
            "mlx_actors_replies",
            "Replies, by API and finish reason.",
            ["api", "finish_reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "mlx_actors_cancelled_turns",
            "Turns cancelled by a client that left.",
            ["api"],
            registry=r,
        )
        self.in_flight = Gauge(
            "mlx_actors_requests_in_flight", "Requests being answered.", registry=r
        )
        self.ttft = Histogram(
            "mlx_actors_time_to_first_token_seconds",
            "Seconds from a turn's start in its agent to its first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            "mlx_actors_time_per_output_token_seconds",
            "Seconds per generated token after the first, per reply.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )

    def replied(self, api: str, reply: Reply, finish_reason: str) -> None:
        self.replies.labels(api, finish_reason).inc()
        self.ttft.observe(reply.ttft_s)
        decoded = reply.usage.generated_tokens - 1
        if decoded > 0:
            self.per_token.observe((reply.total_s - reply.ttft_s) / decoded)

    async def exposition(self) -> bytes:
        """The metrics in Prometheus' text format, the runtime's read now."""
        self._snapshot.stats = await self._rt.stats()
        self._snapshot.queued = sum(a.statistics().queued for a in self._rt.agents.values())
        return generate_latest(self.registry)
