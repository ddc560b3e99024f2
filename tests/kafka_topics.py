"""Delete a test's topics when it ends: the shared broker keeps only what tests still use.

The embedded broker (``noida-db``) keeps every topic in one JSON file that it writes
again whenever its state changes, and writes it while any client is connected: its CPU
grows with the data it holds, up to a whole core of this two-core machine. One test's
180 MB of messages (``tests/bridge/test_inbox_memory.py``) left in it slowed every
later test of the run. A fixture that names its topics under a prefix of its own
(a random tag) deletes them with ``delete_under`` when its test ends; a broker shared
with other tests loses nothing else.
"""

from __future__ import annotations

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient


def delete_under(bootstrap: str, prefix: str, timeout: float = 15.0) -> list[str]:
    """Delete every topic named ``<prefix>.*``; return their names. Best effort: a
    topic the broker fails to delete is left (the test's verdict stands)."""
    if not prefix:
        raise ValueError("an empty prefix would name every topic")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        names = [name for name in admin.list_topics(timeout=timeout).topics
                 if name.startswith(f"{prefix}.")]
    except KafkaException:
        return []
    deleted = []
    if names:
        for name, future in admin.delete_topics(names, operation_timeout=timeout).items():
            try:
                future.result(timeout)
                deleted.append(name)
            except Exception:  # noqa: BLE001 -- best effort, see the docstring
                pass
    return deleted
