"""Kafka client settings from the environment, shared by the bridge's relays and commands.

``KAFKA_BOOTSTRAP_SERVERS`` names the brokers. Any other ``KAFKA_*`` variable is
a librdkafka setting: ``KAFKA_SECURITY_PROTOCOL=SASL_SSL`` becomes
``security.protocol=SASL_SSL``. Only confluent-kafka talks to the broker, so the
same code runs against Apache Kafka, Redpanda or the embedded dev broker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Variables that look like client settings but are not: Heroku's Kafka add-on
# sets these, and librdkafka refuses unknown properties at client creation.
NOT_SETTINGS = frozenset({
    "KAFKA_BOOTSTRAP_SERVERS", "KAFKA_URL", "KAFKA_PREFIX", "KAFKA_TRUSTED_CERT",
    "KAFKA_CLIENT_CERT", "KAFKA_CLIENT_CERT_KEY",
})
SECRET_WORDS = ("password", "secret", "key", "token")


def bootstrap_servers(env: Mapping[str, str] | None = None) -> str:
    """Return ``KAFKA_BOOTSTRAP_SERVERS`` or fail with a message saying what is missing."""
    env = os.environ if env is None else env
    servers = env.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if not servers:
        raise SystemExit("KAFKA_BOOTSTRAP_SERVERS is not set (e.g. 127.0.0.1:9092)")
    return servers


def client_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return librdkafka settings: bootstrap servers plus every extra ``KAFKA_*`` variable."""
    env = os.environ if env is None else env
    settings = {"bootstrap.servers": bootstrap_servers(env)}
    for name, value in env.items():
        if name.startswith("KAFKA_") and name not in NOT_SETTINGS:
            settings[name[len("KAFKA_"):].lower().replace("_", ".")] = value
    return settings


def describe(settings: Mapping[str, str]) -> str:
    """Render settings for a log line, hiding anything that looks like a credential."""
    return ", ".join(
        f"{k}={'***' if any(w in k for w in SECRET_WORDS) else v}"
        for k, v in sorted(settings.items())
    )
