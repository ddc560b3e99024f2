"""The inbox's Prometheus metrics (docs/operations/metrics.md)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)


class InboxMetrics:
    """The relay's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.lag = Gauge("poimen_inbox_lag",
                         "Inbox lag: high watermark minus the group's committed offset.",
                         ["topic", "partition"], registry=r)
        self.admitted = Counter("poimen_inbox_admitted_total",
                                "Messages the API admitted as new runs (201).", registry=r)
        self.replayed = Counter("poimen_inbox_replayed_total",
                                "Messages admission recognised as a replay (200).", registry=r)
        # The name every process family's docs use for dead letters (docs/operations/metrics.md).
        self.dlq = Counter("poimen_dlq_total", "Messages written to a dead-letter topic, by reason.",
                           ["reason"], registry=r)
        self.dead_lettered = Counter("poimen_inbox_dead_lettered_total",
                                     "Messages written to the dead-letter topic, by reason.",
                                     ["reason"], registry=r)
        self.retries = Counter("poimen_inbox_retries_total",
                               "Deliveries to retry (API down, 5xx, 429, timeouts), by reason.",
                               ["reason"], registry=r)
        self.api_latency = Histogram("poimen_inbox_api_latency_seconds",
                                     "Latency of one call to the API (POST /v1/runs/batch) "
                                     "as seen by the inbox.", registry=r)
        self.batch_size = Histogram("poimen_inbox_batch_size",
                                    "Messages per POST /v1/runs/batch.",
                                    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
                                    registry=r)
        self.assigned = Gauge("poimen_inbox_assigned_partitions",
                              "Dispatch partitions assigned to this relay.", registry=r)
        self.derived_keys = Counter(
            "poimen_inbox_derived_keys_total",
            "Messages without a dispatch_key admitted under a derived kafka:<topic>:... key.",
            registry=r)
        self.internal_errors = Counter("poimen_inbox_internal_errors_total",
                                       "Exceptions raised by the relay's own code on a message.",
                                       registry=r)
        self.dlq_in_flight = Gauge("poimen_inbox_dlq_writes_in_flight",
                                   "Dead-letter writes waiting for the broker's acknowledgement.",
                                   registry=r)
        self.buffered_bytes = Gauge("poimen_inbox_buffered_bytes",
                                    "Bytes of fetched messages not yet committed "
                                    "(bounded by POIMEN_INBOX_BUFFER_BYTES).", registry=r)
        self.dlq_truncated = Counter("poimen_inbox_dlq_truncated_total",
                                     "Dead letters cut to fit the producer's message size limit.",
                                     registry=r)
