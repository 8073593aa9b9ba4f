"""Prometheus metrics of the engine (names follow vLLM's, with the ``inferd:`` prefix)."""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


_families: "weakref.WeakKeyDictionary[CollectorRegistry, dict]" = weakref.WeakKeyDictionary()


def _make_families(r: CollectorRegistry) -> dict:
    labels = ["model_name"]
    return {
        "requests": Counter("inferd:request_success", "Finished requests by finish reason",
                            labels + ["finished_reason"], registry=r),
        "prompt_tokens": Counter("inferd:prompt_tokens", "Prompt tokens processed", labels, registry=r),
        "generation_tokens": Counter("inferd:generation_tokens", "Tokens generated", labels, registry=r),
        "prefix_cache_hits": Counter("inferd:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     labels, registry=r),
        "preemptions": Counter("inferd:num_preemptions", "Requests preempted", labels, registry=r),
        "running": Gauge("inferd:num_requests_running", "Requests in the running batch", labels, registry=r),
        "waiting": Gauge("inferd:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r),
        "kv_blocks_used": Gauge("inferd:kv_cache_blocks_used", "KV-cache blocks held by requests", labels,
                                registry=r),
        "kv_blocks_total": Gauge("inferd:kv_cache_blocks_total", "KV-cache blocks in all", labels, registry=r),
        "kv_usage": Gauge("inferd:kv_cache_usage_perc", "Fraction of KV-cache blocks held (0-1)", labels,
                          registry=r),
        "ttft": Histogram("inferd:time_to_first_token_seconds", "Time to first token (TTFT)", labels,
                          buckets=_LATENCY_BUCKETS, registry=r),
        "itl": Histogram("inferd:inter_token_latency_seconds", "Inter-token latency (ITL)", labels,
                         buckets=_LATENCY_BUCKETS, registry=r),
        "e2e": Histogram("inferd:e2e_request_latency_seconds", "End-to-end request latency", labels,
                         buckets=_LATENCY_BUCKETS, registry=r),
    }


class EngineMetrics:
    """Counters, gauges and histograms of one model, labelled ``model_name``; several engines (models)
    can share a registry.

    Units: seconds for latencies, tokens for token counts, blocks for KV usage.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        fam = _families.get(self.registry)
        if fam is None:  # one set of families per registry; each engine (model) is a label value
            fam = _families[self.registry] = _make_families(self.registry)
        for attr, family in fam.items():
            setattr(self, attr, family)
        self.model_name = model_name
        for m in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_hits, self.preemptions,
                  self.running, self.waiting, self.kv_blocks_used, self.kv_blocks_total, self.kv_usage,
                  self.ttft, self.itl, self.e2e):
            m.labels(model_name)  # export zero values from the start
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(model_name, reason)

    def of(self, model_name: str) -> "ModelSeries":
        """The series of ``model_name``, looked up once: ``Family.labels()`` takes a lock and hashes the label
        tuple on every call, ~0.7 us, and the engine records two to three series per generated token (~53 us of a
        32-row decode step; docs/performance.md, stop 53)."""
        return ModelSeries(self, model_name)


class ModelSeries:
    """One model's children of the :class:`EngineMetrics` families (prometheus_client's labelled series),
    for the engine's per-token and per-request updates. Units as in :class:`EngineMetrics`."""

    def __init__(self, m: EngineMetrics, model_name: str) -> None:
        self.prompt_tokens = m.prompt_tokens.labels(model_name)
        self.generation_tokens = m.generation_tokens.labels(model_name)
        self.prefix_cache_hits = m.prefix_cache_hits.labels(model_name)
        self.preemptions = m.preemptions.labels(model_name)
        self.ttft = m.ttft.labels(model_name)
        self.itl = m.itl.labels(model_name)
        self.e2e = m.e2e.labels(model_name)
        self.requests = {reason: m.requests.labels(model_name, reason)
                         for reason in ("stop", "length", "abort", "error")}
