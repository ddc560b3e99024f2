"""The Kafka inbox: ``<prefix>.<tenant>.dispatch`` messages become runs via the API.

The relay is an HTTP client of the API, never an in-process caller of
admission, so every run it creates went through the same validation, auth and
``dispatch_key`` dedup as a request made with curl. It keeps no idempotency
state of its own: a redelivered message is replayed at admission (200), not
filtered here, because two dedup layers disagree exactly when things go wrong.
A message without a ``dispatch_key`` is admitted under one derived from its
place in the log and its stored time
(``kafka:<topic>:<partition>:<offset>:<timestamp_ms>``), so it too is one run
under any redelivery, and a re-created topic's messages are not taken for the
old topic's.

Offsets are committed per partition, in order, and only past messages that
either the API admitted (a 200/201 whose body is a run) or the dead-letter
topic acknowledged. Failures are of two kinds (``bridge.inbox.faults``): a
*message fault* goes to ``<prefix>.<tenant>.dispatch.dlq`` with the reason and
its origin in headers, at once, so no message can stall its partition; a
*delivery fault* is retried with capped, jittered exponential backoff while its
partition is paused, and is never skipped. An exception from the relay's own
code is retried, and becomes a message fault on the third consecutive try on
the same offset: a bug must not strand a partition.

Each partition's messages are posted in batches, one ``POST /v1/runs/batch`` per
batch (up to ``batch_max`` messages, lingering ``batch_linger_ms`` for more), and
each message ends as it would have alone: its item of the answer is judged by the
single request's table, a whole-batch fault is every message's, and a batch the
server refuses as such (413) is split, down to a lone ``POST /v1/runs``.

Run it as ``python -m bridge.inbox`` (the Procfile's ``inbox``). Settings come
from the environment when it starts: ``poimenconfig.inbox_settings``.

The package, by role:

- ``relay``: ``Inbox``, the threads and the one lock (consume, dispatch, drain,
  rebalance, commit, shut down) and ``main``;
- ``partitions``: the partition state machine (``PartitionWork``, ``Slot``);
- ``faults``: whose fault an answer or a message is (no I/O);
- ``outcomes``: what became of one delivery (``Outcome``);
- ``messages``: a message's trace context and batch entry;
- ``metrics``: the Prometheus metrics.

A dead letter's headers are written and read by ``bridge.deadletter``, the codec
the replay (``bridge.dlq``) reads them with.
"""


from __future__ import annotations

from ..deadletter import DeadLetter, dead_letter_record, traceback_summary
from .faults import Fault, FaultKind, MessageFault
from .messages import BatchEntry, trace_headers
from .metrics import InboxMetrics
from .outcomes import Outcome, OutcomeKind
from .partitions import PartitionWork, Slot, SlotState
from .relay import Inbox, main

__all__ = [
    "BatchEntry",
    "DeadLetter",
    "Fault",
    "FaultKind",
    "Inbox",
    "InboxMetrics",
    "MessageFault",
    "Outcome",
    "OutcomeKind",
    "PartitionWork",
    "Slot",
    "SlotState",
    "dead_letter_record",
    "main",
    "trace_headers",
    "traceback_summary",
]
