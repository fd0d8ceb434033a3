"""Prometheus metrics of one server, under vLLM's names, in a registry of its own.

Concept: ``GET /metrics`` in Prometheus' text format. The engine's state (requests
running and waiting, KV-cache usage, prefix-cache lookups, preemptions) is read from
``AsyncLLM.stats`` when Prometheus scrapes, by a collector; the two latencies are
histograms that the server fills as tokens reach each client.

Mirrors: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``). The names are vLLM's,
with its ``vllm:`` prefix and its ``model_name`` label, so dashboards and queries written
for vLLM read this server unchanged. Counters get the ``_total`` suffix in the text
format, as prometheus_client writes every counter (``vllm:prefix_cache_hits_total``).

NOTE 1 (one registry per app): each ``ServerMetrics`` has its own ``CollectorRegistry``
rather than prometheus_client's global one, so several servers can run in one process
(the tests start more than one) without a "Duplicated timeseries" error.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# --8<-- [start:metric_names]
METRICS = {  # name: (type, help)
    "vllm:num_requests_running": ("gauge", "Requests in the running queue (scheduled this step)."),
    "vllm:num_requests_waiting": ("gauge", "Requests waiting to be scheduled, preempted ones included."),
    "vllm:kv_cache_usage_perc": ("gauge", "Fraction of KV-cache blocks in use, from 0 to 1 (0: every block is free)."),
    "vllm:prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache."),
    "vllm:prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache."),
    "vllm:num_preemptions": ("counter", "Requests preempted (their blocks freed, to be recomputed)."),
    "vllm:time_to_first_token_seconds": ("histogram", "Seconds from a request's arrival to its first token."),
    "vllm:inter_token_latency_seconds": ("histogram", "Seconds between two successive output tokens of a request."),
}
# --8<-- [end:metric_names]
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads ``AsyncLLM.stats`` at scrape time (a snapshot the engine thread replaces after every call)."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.async_llm = async_llm
        self.model_name = model_name

    def collect(self):
        stats = self.async_llm.stats
        values = {
            "vllm:num_requests_running": stats.num_running_reqs,
            "vllm:num_requests_waiting": stats.num_waiting_reqs,
            "vllm:kv_cache_usage_perc": stats.kv_cache_usage,
            "vllm:prefix_cache_queries": stats.prefix_cache_queries,
            "vllm:prefix_cache_hits": stats.prefix_cache_hits,
            "vllm:num_preemptions": stats.num_preemptions,
        }
        for name, value in values.items():
            kind, documentation = METRICS[name]
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, documentation, labels=["model_name"]
            )
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """The metrics of one server (NOTE 1)."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_llm, model_name))

        def histogram(name: str) -> Histogram:
            return Histogram(
                name, METRICS[name][1], ["model_name"], registry=self.registry, buckets=LATENCY_BUCKETS
            ).labels(model_name)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds")

    def render(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
