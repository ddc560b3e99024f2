"""Kafka client settings from the environment, shared by the bridge's relays and commands.

``KAFKA_BOOTSTRAP_SERVERS`` names the brokers. Any other ``KAFKA_*`` variable is
a librdkafka setting: ``KAFKA_SECURITY_PROTOCOL=SASL_SSL`` becomes
``security.protocol=SASL_SSL``. Only confluent-kafka talks to the broker, so the
same code runs against Apache Kafka, Redpanda or the embedded dev broker.

Apache Kafka on Heroku sets other names, translated here: ``KAFKA_URL``
(``kafka+ssl://host:port,...``) gives the brokers and ``security.protocol=SSL``
when ``KAFKA_BOOTSTRAP_SERVERS`` is unset; ``KAFKA_TRUSTED_CERT``,
``KAFKA_CLIENT_CERT`` and ``KAFKA_CLIENT_CERT_KEY`` (PEM contents) become
``ssl.ca.pem``, ``ssl.certificate.pem`` and ``ssl.key.pem``. An explicit
``KAFKA_*`` setting always wins over a translated one. ``KAFKA_PREFIX`` is
applied to topic and group names by ``bridge.topics``.
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
SECRET_WORDS = ("password", "secret", "key", "token", "pem")
# Heroku's PEM variables and the librdkafka settings that take their contents.
HEROKU_PEMS = {
    "KAFKA_TRUSTED_CERT": "ssl.ca.pem",
    "KAFKA_CLIENT_CERT": "ssl.certificate.pem",
    "KAFKA_CLIENT_CERT_KEY": "ssl.key.pem",
}


def _url_hosts(url: str) -> list[tuple[str, str]]:
    """Split ``kafka+ssl://h1:9096,kafka+ssl://h2:9096`` into ``(scheme, host:port)`` pairs."""
    pairs = []
    for item in url.split(","):
        scheme, sep, rest = item.strip().partition("://")
        if not sep:
            scheme, rest = "", scheme
        if rest.strip("/"):
            pairs.append((scheme.lower(), rest.strip("/")))
    return pairs


def bootstrap_servers(env: Mapping[str, str] | None = None) -> str:
    """Return ``KAFKA_BOOTSTRAP_SERVERS`` (else Heroku's ``KAFKA_URL`` as ``host:port,...``)."""
    env = os.environ if env is None else env
    servers = env.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if not servers:
        servers = ",".join(host for _, host in _url_hosts(env.get("KAFKA_URL", "")))
    if not servers:
        raise SystemExit("KAFKA_BOOTSTRAP_SERVERS is not set (e.g. 127.0.0.1:9092), "
                         "nor Heroku's KAFKA_URL")
    return servers


def heroku_settings(env: Mapping[str, str]) -> dict[str, str]:
    """Return the librdkafka settings Heroku's ``KAFKA_URL`` and PEM variables stand for."""
    settings = {}
    if not env.get("KAFKA_BOOTSTRAP_SERVERS", "").strip():
        schemes = {scheme for scheme, _ in _url_hosts(env.get("KAFKA_URL", ""))}
        if "kafka+ssl" in schemes:
            settings["security.protocol"] = "SSL"
    for variable, setting in HEROKU_PEMS.items():
        if env.get(variable, "").strip():
            settings[setting] = env[variable]
    if "ssl.ca.pem" in settings:
        # Heroku's broker certificates are signed by the trusted CA but do not name
        # the broker hosts: verify the chain, not the host name.
        settings["ssl.endpoint.identification.algorithm"] = "none"
    return settings


def client_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return librdkafka settings: bootstrap servers plus every extra ``KAFKA_*`` variable."""
    env = os.environ if env is None else env
    settings = {"bootstrap.servers": bootstrap_servers(env), **heroku_settings(env)}
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
