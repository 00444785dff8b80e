"""The ``sglang:`` Prometheus metrics a server exposes on ``/metrics`` (only with ``--enable-metrics``).

Names, types, label sets and buckets follow SGLang 0.5.23
``sglang/srt/observability/metrics_collector.py``:

* scheduler metrics (``SchedulerMetricsCollector``) carry ``model_name``, ``engine_type``
  (``prefill``/``decode``/``unified`` from ``DisaggregationMode.to_engine_type``), ``tp_rank``,
  ``pp_rank``, ``moe_ep_rank``;
* tokenizer metrics (``TokenizerMetricsCollector``) carry ``model_name``, ``engine_type`` and, for the
  per-request ones, ``is_streaming``.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

try:  # keep the exposition free of *_created samples, as SGLang's multiprocess registry is
    prometheus_client.disable_created_metrics()
except AttributeError:  # pragma: no cover - very old prometheus_client
    pass

_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
                 100.0, 200.0, 400.0)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
                0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
                200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)


def engine_type(mode: str) -> str:
    return {"prefill": "prefill", "decode": "decode"}.get(mode, "unified")


class Metrics:
    def __init__(self, served_model_name: str, mode: str, max_total_num_tokens: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        et = engine_type(mode)
        self.sched_labels: dict[str, Any] = {
            "model_name": served_model_name, "engine_type": et,
            "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0",
        }
        self.tok_labels: dict[str, Any] = {"model_name": served_model_name, "engine_type": et}
        sl, tl = list(self.sched_labels), list(self.tok_labels)
        r = self.registry

        def g(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, sl, registry=r)

        self.num_running_reqs = g("sglang:num_running_reqs", "The number of running requests.")
        self.num_used_tokens = g("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = g("sglang:token_usage", "The token usage.")
        self.gen_throughput = g("sglang:gen_throughput", "The generation throughput (token/s).")
        self.num_queue_reqs = g("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.cache_hit_rate = g("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.max_total_num_tokens = g("sglang:max_total_num_tokens",
                                      "Maximum total number of tokens in the KV cache pool.")
        self.kv_used_tokens = g("sglang:kv_used_tokens", "KV cache tokens in use.")
        self.kv_available_tokens = g("sglang:kv_available_tokens", "KV cache tokens available.")
        self.num_retracted_reqs = g("sglang:num_retracted_reqs", "The number of retracted requests.")
        self.num_prefill_bootstrap_queue_reqs = g("sglang:num_prefill_bootstrap_queue_reqs",
                                                  "The number of requests in the prefill bootstrap queue.")
        self.num_prefill_inflight_queue_reqs = g("sglang:num_prefill_inflight_queue_reqs",
                                                 "The number of requests in the prefill inflight queue.")
        self.num_decode_prealloc_queue_reqs = g("sglang:num_decode_prealloc_queue_reqs",
                                                "The number of requests in the decode prealloc queue.")
        self.num_decode_transfer_queue_reqs = g("sglang:num_decode_transfer_queue_reqs",
                                                "The number of requests in the decode transfer queue.")
        self.pending_prealloc_token_usage = g("sglang:pending_prealloc_token_usage",
                                              "The token usage for pending preallocated tokens.")
        self.kv_transfer_speed_gb_s = Histogram(
            "sglang:kv_transfer_speed_gb_s", "Histogram of KV cache transfer speed in GB/s.", sl,
            buckets=(0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400), registry=r)
        self.kv_transfer_latency_ms = Histogram(
            "sglang:kv_transfer_latency_ms", "Histogram of KV cache transfer latency in ms.", sl,
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000), registry=r)
        self.kv_transfer_bootstrap_ms = Histogram(
            "sglang:kv_transfer_bootstrap_ms", "Histogram of KV transfer bootstrap time in ms.", sl,
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500), registry=r)
        self.kv_transfer_alloc_ms = Histogram(
            "sglang:kv_transfer_alloc_ms", "Histogram of KV transfer allocation waiting time in ms.", sl,
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500), registry=r)
        self.kv_transfer_total_mb = Histogram(
            "sglang:kv_transfer_total_mb", "Histogram of KV cache transfer size in MB.", sl,
            buckets=(1, 5, 10, 50, 100, 500, 1000, 5000, 10000), registry=r)
        self.num_bootstrap_failed_reqs = Counter(
            "sglang:num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests.", sl,
            registry=r)
        self.num_transfer_failed_reqs = Counter(
            "sglang:num_transfer_failed_reqs_total", "The number of transfer failed requests.", sl,
            registry=r)
        self.num_prefill_retries = Counter(
            "sglang:num_prefill_retries_total", "Total number of prefill retries.", sl, registry=r)

        tls = tl + ["is_streaming"]
        self.prompt_tokens_total = Counter("sglang:prompt_tokens_total",
                                           "Number of prefill tokens processed.", tls, registry=r)
        self.generation_tokens_total = Counter("sglang:generation_tokens_total",
                                               "Number of generation tokens processed.", tls, registry=r)
        self.num_requests_total = Counter("sglang:num_requests_total",
                                          "Number of requests processed.", tl, registry=r)
        self.num_aborted_requests_total = Counter("sglang:num_aborted_requests_total",
                                                  "Number of requests aborted.", tl, registry=r)
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", tls,
            buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", tl,
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
            tls, buckets=_E2E_BUCKETS, registry=r)

        s = self.sched_labels
        self.max_total_num_tokens.labels(**s).set(max_total_num_tokens)
        self.kv_available_tokens.labels(**s).set(max_total_num_tokens)
        for m in (self.num_running_reqs, self.num_used_tokens, self.token_usage, self.gen_throughput,
                  self.num_queue_reqs, self.cache_hit_rate, self.kv_used_tokens, self.num_retracted_reqs,
                  self.num_prefill_bootstrap_queue_reqs, self.num_prefill_inflight_queue_reqs,
                  self.num_decode_prealloc_queue_reqs, self.num_decode_transfer_queue_reqs,
                  self.pending_prealloc_token_usage):
            m.labels(**s).set(0)
        for c in (self.num_bootstrap_failed_reqs, self.num_transfer_failed_reqs, self.num_prefill_retries):
            c.labels(**s)
        for c in (self.num_requests_total, self.num_aborted_requests_total):
            c.labels(**self.tok_labels)

    def s(self, metric):  # scheduler-labelled child
        return metric.labels(**self.sched_labels)

    def t(self, metric, streaming: bool | None = None):  # tokenizer-labelled child
        if streaming is None:
            return metric.labels(**self.tok_labels)
        return metric.labels(**self.tok_labels, is_streaming=str(bool(streaming)).lower())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
