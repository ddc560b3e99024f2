"""What both relays share about Kafka: settings for log lines, size limits, a record's
headers and place. The settings themselves come from ``poimenconfig``.

``poimenconfig.kafka_client_settings`` reads them when a process starts:
``KAFKA_BOOTSTRAP_SERVERS`` names the brokers, any other ``KAFKA_*`` variable is a
librdkafka setting, and Heroku's ``KAFKA_URL`` and PEM variables are translated.
Only confluent-kafka talks to the broker, so the same code runs against Apache
Kafka, Redpanda or the embedded dev broker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from confluent_kafka import KafkaError, Message

# A Kafka record's headers as the relays keep them: name, raw value (None: a null value).
Headers = list[tuple[str, bytes | None]]
# What confluent-kafka gives and takes as headers.
KafkaHeaders = (Mapping[str, str | bytes | None]
                | Sequence[tuple[str, str | bytes | None]])


def _raw(value: str | bytes | None) -> bytes | None:
    return value.encode("utf-8", "replace") if isinstance(value, str) else value


def header_list(headers: KafkaHeaders | None) -> Headers:
    """Return a record's headers as a list of ``(name, bytes or None)``, in order."""
    items = headers.items() if isinstance(headers, Mapping) else (headers or ())
    return [(name, _raw(value)) for name, value in items]


def kafka_headers(headers: Sequence[tuple[str, str | bytes | None]],
                  ) -> list[tuple[str, str | bytes | None]]:
    """``headers`` as confluent-kafka's ``produce`` takes them."""
    return list(headers)


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


def place(msg: Message) -> tuple[str, int, int]:
    """A consumed message's topic, partition and offset (set on every message without an error)."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError(f"a message without its place in the log: {msg.error()}")
    return topic, partition, offset


def offset_of(msg: Message) -> int:
    """A consumed message's offset (set on every message without an error)."""
    offset = msg.offset()
    if offset is None:
        raise ValueError(f"a message without its offset: {msg.error()}")
    return offset
