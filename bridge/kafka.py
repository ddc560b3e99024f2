"""Kafka client settings for log lines; the settings themselves come from ``poimenconfig``.

``poimenconfig.kafka_client_settings`` reads them when a process starts:
``KAFKA_BOOTSTRAP_SERVERS`` names the brokers, any other ``KAFKA_*`` variable is a
librdkafka setting, and Heroku's ``KAFKA_URL`` and PEM variables are translated.
Only confluent-kafka talks to the broker, so the same code runs against Apache
Kafka, Redpanda or the embedded dev broker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from confluent_kafka import KafkaError

SECRET_WORDS = ("password", "secret", "key", "token", "pem")


def describe(settings: Mapping[str, str]) -> str:
    """Render settings for a log line, hiding anything that looks like a credential."""
    return ", ".join(
        f"{k}={'***' if any(w in k for w in SECRET_WORDS) else v}"
        for k, v in sorted(settings.items())
    )


# librdkafka's default message.max.bytes: the largest record a producer sends.
DEFAULT_MAX_MESSAGE_BYTES = 1_000_000

# A record (or a request of records) over a size limit: the producer's own
# message.max.bytes, refused at produce(), or the broker's message.max.bytes or
# the topic's max.message.bytes, in the delivery report.
SIZE_ERRORS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})


def max_message_bytes(settings: Mapping[str, str]) -> int:
    """The producer's ``message.max.bytes`` (``KAFKA_MESSAGE_MAX_BYTES``), else librdkafka's."""
    return int(settings.get("message.max.bytes", DEFAULT_MAX_MESSAGE_BYTES))


def message_size(value: bytes, key: bytes, headers: Iterable[tuple[str, str | bytes]]) -> int:
    """What librdkafka counts against ``message.max.bytes``: value, key and headers."""
    return len(value) + len(key) + sum(
        len(name.encode()) + len(v if isinstance(v, bytes) else v.encode())
        for name, v in headers)
