"""Prometheus metrics of one server, under vLLM's names, in a registry of its own.

Concept: ``GET /metrics`` in Prometheus' text format. The engine's state (requests
running and waiting, KV-cache usage, prefix-cache lookups, preemptions) is read from
``AsyncLLM.stats`` when Prometheus scrapes, by a collector; the token counters, the
finished-request counter, the three latency histograms and the three phase histograms
(queue, prefill, decode) are filled by the server, one ``RequestTracker`` per engine
request, as its outputs reach the client; the tokens of each engine step by an observer
of the engine (NOTE 3).

Mirrors: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``). The names are vLLM's,
with its ``vllm:`` prefix and its ``model_name`` label, so dashboards and queries written
for vLLM read this server unchanged. Counters get the ``_total`` suffix in the text
format, as prometheus_client writes every counter (``vllm:prefix_cache_hits_total``).

NOTE 1 (one registry per app): each ``ServerMetrics`` has its own ``CollectorRegistry``
rather than prometheus_client's global one, so several servers can run in one process
(the tests start more than one) without a "Duplicated timeseries" error.
NOTE 2 (what counts): prompt tokens once per engine request, at its first output (its
prefill is done); generation tokens as they arrive; ``request_success`` once per
completion (``n`` per engine request), labelled with its ``finish_reason``, as vLLM V1
counts each of the ``n`` child requests; a client that leaves ends its unfinished
completions as ``abort``. End-to-end latency runs from the HTTP request's arrival to the
engine request's end.
NOTE 3 (phases and steps, vLLM's definitions): queue time is a request's first scheduling
minus its arrival in the engine, prefill time its first token minus that scheduling,
decode time its end minus its first token, all read from the finished output's
``RequestMetrics`` (the engine's clock), once per engine request the engine finished (one
a client left is not, as in vLLM); queue and prefill need ``scheduled_time``, which is
observed only where the engine recorded it. ``iteration_tokens_total`` takes each step's
``total_num_scheduled_tokens`` as one of the engine's step observers (``step_observers.py``;
the app adds it when it starts and removes it when it stops, so a trace can record
a served engine and a second server on the engine counts its own steps), so a prompt counts
in the steps that compute its chunks; vLLM counts a prompt whole in the step of its first
token, plus the tokens sampled.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# --8<-- [start:metric_names]
METRICS = {  # name: (type, help)
    "vllm:num_requests_running": ("gauge", "Requests in the running queue (scheduled this step)."),
    "vllm:num_requests_waiting": ("gauge", "Requests waiting to be scheduled, preempted ones included."),
    "vllm:kv_cache_usage_perc": ("gauge", "Fraction of KV-cache blocks in use, from 0 to 1 (0: every block is free)."),
    "vllm:prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache."),
    "vllm:prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache."),
    "vllm:num_preemptions": ("counter", "Requests preempted (their blocks freed, to be recomputed)."),
    "vllm:prompt_tokens": ("counter", "Prompt tokens of the requests served (prefilled)."),
    "vllm:generation_tokens": ("counter", "Tokens generated."),
    "vllm:request_success": ("counter", "Completions finished, by finished_reason (stop, length, abort)."),
    "vllm:time_to_first_token_seconds": ("histogram", "Seconds from a request's arrival to its first token."),
    "vllm:inter_token_latency_seconds": ("histogram", "Seconds between two successive output tokens of a request."),
    "vllm:e2e_request_latency_seconds": ("histogram", "Seconds from a request's arrival to its end."),
    "vllm:request_queue_time_seconds": ("histogram", "Seconds a request waited before its first step (WAITING)."),
    "vllm:request_prefill_time_seconds": ("histogram", "Seconds from a request's first step to its first token."),
    "vllm:request_decode_time_seconds": ("histogram", "Seconds from a request's first token to its last."),
    "vllm:iteration_tokens_total": ("histogram", "Tokens computed per engine step (prompt chunks, decodes, drafts)."),
    "vllm:spec_decode_num_drafts": ("counter", "Verification steps of requests that carried drafts."),
    "vllm:spec_decode_num_draft_tokens": ("counter", "Draft tokens verified."),
    "vllm:spec_decode_num_accepted_tokens": ("counter", "Draft tokens the target model kept."),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", "Draft tokens kept, by their position among the drafts."),
}
# --8<-- [end:metric_names]
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # vLLM's  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values


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
            "vllm:spec_decode_num_drafts": stats.spec_num_drafts,
            "vllm:spec_decode_num_draft_tokens": stats.spec_num_draft_tokens,
            "vllm:spec_decode_num_accepted_tokens": stats.spec_num_accepted_tokens,
        }
        for name, value in values.items():
            kind, documentation = METRICS[name]
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, documentation, labels=["model_name"]
            )
            family.add_metric([self.model_name], value)
            yield family
        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        family = CounterMetricFamily(name, METRICS[name][1], labels=["model_name", "position"])
        for position, value in enumerate(stats.spec_num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(position)], value)
        yield family


class ServerMetrics:
    """The metrics of one server (NOTE 1)."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_llm, model_name))

        def histogram(name: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, METRICS[name][1], ["model_name"], registry=self.registry, buckets=buckets).labels(
                model_name
            )

        def counter(name: str) -> Counter:
            return Counter(name, METRICS[name][1], ["model_name"], registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds")
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds", E2E_BUCKETS)
        self.request_queue_time = histogram("vllm:request_queue_time_seconds", E2E_BUCKETS)  # vLLM's buckets
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds", E2E_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds", E2E_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", ITERATION_TOKEN_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens")
        self.generation_tokens = counter("vllm:generation_tokens")
        success = Counter("vllm:request_success", METRICS["vllm:request_success"][1], ["model_name", "finished_reason"],
                          registry=self.registry)  # fmt: skip
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}

    def render(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def on_step(self, engine, scheduler_output, core_outputs, error: BaseException | None) -> None:
        """A step observer, called in the engine's thread: the tokens a step computed (NOTE 3)."""
        if error is None and scheduler_output.total_num_scheduled_tokens:
            self.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)

    def request_finished(self, times) -> None:
        """A finished engine request's phases, from the engine's ``RequestMetrics`` (NOTE 3)."""
        first, scheduled = times.first_token_time, times.scheduled_time
        if scheduled is not None:
            self.request_queue_time.observe(scheduled - times.arrival_time)
            if first is not None:
                self.request_prefill_time.observe(first - scheduled)
        if first is not None and times.finished_time is not None:
            self.request_decode_time.observe(times.finished_time - first)


# --8<-- [start:tracker]
class RequestTracker:
    """The metrics of one engine request, fed with each of its outputs (NOTE 2)."""

    def __init__(self, metrics: ServerMetrics, n: int, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = self.last = arrival
        self.unfinished = n  # completions not yet ended
        self.seen_first = False
        self.done = False

    def output(self, out) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if not self.seen_first:
            metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        if new_tokens:
            metrics.generation_tokens.inc(new_tokens)
            if not self.seen_first:
                metrics.time_to_first_token.observe(now - self.arrival)
            else:
                for _ in range(new_tokens):  # several tokens in one output share the gap
                    metrics.inter_token_latency.observe((now - self.last) / new_tokens)
            self.last = now
        self.seen_first = True
        for completion in out.outputs:
            if completion.finish_reason is not None:
                self.unfinished -= 1
                metrics.request_success.get(completion.finish_reason, metrics.request_success["abort"]).inc()
        if out.finished:
            metrics.request_finished(out.metrics)
            self.end(now)

    def end(self, now: float | None = None) -> None:
        """The request ended: finished, or its client left (its open completions count as aborted)."""
        if self.done:
            return
        self.done = True
        if self.unfinished > 0:
            self.metrics.request_success["abort"].inc(self.unfinished)
        self.metrics.e2e_request_latency.observe((now or time.perf_counter()) - self.arrival)
# --8<-- [end:tracker]
