"""Kafka client settings for log lines; the settings themselves come from ``poimenconfig``.

``poimenconfig.kafka_client_settings`` reads them when a process starts:
``KAFKA_BOOTSTRAP_SERVERS`` names the brokers, any other ``KAFKA_*`` variable is a
librdkafka setting, and Heroku's ``KAFKA_URL`` and PEM variables are translated.
Only confluent-kafka talks to the broker, so the same code runs against Apache
Kafka, Redpanda or the embedded dev broker.
"""

from __future__ import annotations

from collections.abc import Mapping

SECRET_WORDS = ("password", "secret", "key", "token", "pem")


def describe(settings: Mapping[str, str]) -> str:
    """Render settings for a log line, hiding anything that looks like a credential."""
    return ", ".join(
        f"{k}={'***' if any(w in k for w in SECRET_WORDS) else v}"
        for k, v in sorted(settings.items())
    )
