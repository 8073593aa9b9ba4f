"""Per-model Prometheus metrics of the dynamic batcher (the figures Triton exports as ``nv_inference_*``).

Units: seconds for durations, rows (batch elements) for batch sizes.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
_families: "weakref.WeakKeyDictionary[CollectorRegistry, dict]" = weakref.WeakKeyDictionary()


def _metric_families(registry: CollectorRegistry) -> dict:
    fam = _families.get(registry)
    if fam is None:
        labels = ["model", "version"]
        fam = {
            "pending": Gauge("inferd:model_pending_request_count", "Requests waiting in the queue", labels,
                             registry=registry),
            "success": Counter("inferd:model_request_success", "Inference requests that succeeded", labels,
                               registry=registry),
            "failure": Counter("inferd:model_request_failure", "Inference requests that failed, by reason",
                               labels + ["reason"], registry=registry),
            "inferences": Counter("inferd:model_inference_count", "Rows (batch elements) inferred", labels,
                                  registry=registry),
            "executions": Counter("inferd:model_execution_count", "Batches executed by the model's instances",
                                  labels, registry=registry),
            "batch_size": Histogram("inferd:model_batch_size", "Rows per executed batch", labels,
                                    buckets=_BATCH_BUCKETS, registry=registry),
            "queue": Histogram("inferd:model_queue_duration_seconds", "Time a request waited in the queue",
                               labels, buckets=_DURATION_BUCKETS, registry=registry),
            "compute": Histogram("inferd:model_compute_duration_seconds", "Time a batch spent executing",
                                 labels, buckets=_DURATION_BUCKETS, registry=registry),
        }
        _families[registry] = fam
    return fam


class ModelMetrics:
    """The metrics of one model version, labelled ``model`` and ``version``."""

    FAILURE_REASONS = ("rejected", "timeout", "backend", "cancelled")

    def __init__(self, registry: CollectorRegistry, model: str, version: int | str) -> None:
        fam = _metric_families(registry)
        lv = (model, str(version))
        self.pending = fam["pending"].labels(*lv)
        self.success = fam["success"].labels(*lv)
        self.failure = {r: fam["failure"].labels(*lv, r) for r in self.FAILURE_REASONS}
        self.inferences = fam["inferences"].labels(*lv)
        self.executions = fam["executions"].labels(*lv)
        self.batch_size = fam["batch_size"].labels(*lv)
        self.queue = fam["queue"].labels(*lv)
        self.compute = fam["compute"].labels(*lv)
