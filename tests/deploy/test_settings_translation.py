"""Heroku's settings translated.

* ``rediss://``: the TLS options reach Celery (``broker_use_ssl``) and redis-py,
  shown against the real Redis behind a real TLS terminator with a self-signed
  certificate, as Heroku Data for Redis serves one. The terminator is
  ``socat OPENSSL-LISTEN`` in front of the session's Redis: we cannot run
  Heroku's, and the embedded redis-server is built without TLS.
* Apache Kafka on Heroku: ``KAFKA_URL``, the three PEM variables and
  ``KAFKA_PREFIX`` become librdkafka settings and prefixed topic and group
  names. The PEMs are real (made here with openssl) so that creating a
  confluent-kafka client with the translated settings proves librdkafka
  accepts every name and value.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import uuid
from pathlib import Path

import pytest
import redis as redis_lib

from bridge.kafka import describe
from bridge.topics import dead_letter_topic, dispatch_topic, events_topic
from poimenconfig import (
    REPLAY_GROUP,
    consumer_group,
    inbox_settings,
    kafka_client_settings,
    load_config,
    outbox_settings,
    redis_ssl_options,
    topic_prefix,
)
from tests.processes import Process, free_port, wait_until


def make_cert(directory: Path, name: str, ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (self-signed, or signed by ``ca``)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    if ca is None:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    else:
        csr = directory / f"{name}.csr"
        subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                        "-keyout", str(key), "-out", str(csr)], check=True, capture_output=True)
        subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[0]),
                        "-CAkey", str(ca[1]), "-CAcreateserial", "-days", "1", "-out", str(cert)],
                       check=True, capture_output=True)
    return cert, key


@pytest.fixture
def openssl():
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")


# -- rediss:// ---------------------------------------------------------------------------------


def test_a_rediss_url_yields_certificate_options_and_redis_is_left_alone():
    url = "rediss://:secret@ec2-1-2-3-4.compute-1.amazonaws.com:12345"
    assert redis_ssl_options(url, {}) == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert redis_ssl_options(url, {"POIMEN_REDIS_SSL_CERT_REQS": "none"}) == {
        "ssl_cert_reqs": ssl.CERT_NONE}
    assert redis_ssl_options(url, {"POIMEN_REDIS_SSL_CERT_REQS": "required",
                                   "POIMEN_REDIS_SSL_CA_CERTS": "/etc/ca.pem"}) == {
        "ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ca.pem"}
    assert redis_ssl_options("redis://127.0.0.1:6379/0", {"POIMEN_REDIS_SSL_CERT_REQS": "none"}) \
        is None
    with pytest.raises(ValueError, match="POIMEN_REDIS_SSL_CERT_REQS"):
        redis_ssl_options(url, {"POIMEN_REDIS_SSL_CERT_REQS": "CERT_NOPE"})
    # The broker Celery uses is the one whose options are computed (CELERY_BROKER_URL wins).
    config = load_config({"REDIS_URL": "redis://a:1/0", "CELERY_BROKER_URL": url,
                          "POIMEN_REDIS_SSL_CERT_REQS": "none"})
    assert config["CELERY_BROKER_USE_SSL"] == {"ssl_cert_reqs": ssl.CERT_NONE}
    assert load_config({"REDIS_URL": "redis://a:1/0"})["CELERY_BROKER_USE_SSL"] is None


@pytest.fixture
def tls_redis(base_env, openssl, tmp_path):
    """The session's Redis behind a TLS terminator with a self-signed certificate."""
    if not shutil.which("socat"):
        pytest.skip("socat is not installed (apt-get install -y socat)")
    plain = redis_lib.Redis.from_url(base_env["REDIS_URL"])
    host = plain.connection_pool.connection_kwargs.get("host", "127.0.0.1")
    port = plain.connection_pool.connection_kwargs.get("port", 6379)
    db = plain.connection_pool.connection_kwargs.get("db", 0)
    cert, key = make_cert(tmp_path, "redis-server")
    pem = tmp_path / "redis-server.pem"
    pem.write_text(cert.read_text() + key.read_text())
    tls_port = free_port()
    proc = Process("socat", ["socat", f"OPENSSL-LISTEN:{tls_port},bind=127.0.0.1,reuseaddr,fork,"
                             f"cert={pem},verify=0", f"TCP:{host}:{port}"],
                   {"PATH": "/usr/bin:/bin"}, tmp_path).start()

    def listening() -> bool:
        assert proc.alive(), proc.log()
        with socket.create_connection(("127.0.0.1", tls_port), timeout=1):
            return True

    wait_until(listening, timeout=15, what="the TLS terminator")
    yield f"rediss://127.0.0.1:{tls_port}/{db}", cert, plain
    proc.stop()
    plain.close()


@pytest.mark.processes  # openssl makes its certificates
def test_rediss_with_a_self_signed_certificate_works_for_celery_and_redis_py(
        tls_redis, app, monkeypatch):
    url, cert, plain = tls_redis
    # Verified by default: a self-signed certificate is refused...
    strict = redis_lib.Redis.from_url(url, socket_timeout=5, **redis_ssl_options(url, {}))
    with pytest.raises(redis_lib.ConnectionError, match="certificate verify failed"):
        strict.ping()
    # ...accepted when its CA is given, or when verification is turned off (Heroku).
    for env in ({"POIMEN_REDIS_SSL_CA_CERTS": str(cert)}, {"POIMEN_REDIS_SSL_CERT_REQS": "none"}):
        client = redis_lib.Redis.from_url(url, socket_timeout=5, **redis_ssl_options(url, env))
        assert client.ping(), env
        client.close()

    # Celery as the platform wires it (create_app -> celery_init_app), sending over TLS.
    from app import create_app

    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    monkeypatch.setenv("REDIS_URL", url)
    monkeypatch.setenv("POIMEN_REDIS_SSL_CERT_REQS", "none")
    tls_app = create_app()
    celery_app = tls_app.extensions["celery"]
    assert celery_app.conf.broker_use_ssl == {"ssl_cert_reqs": ssl.CERT_NONE}
    queue = f"tls-check-{uuid.uuid4().hex[:8]}"
    try:
        celery_app.send_task("poimen.tls-check", queue=queue)
        wait_until(lambda: plain.llen(queue) == 1, timeout=15,
                   what="the message sent over rediss:// in the real Redis")
    finally:
        plain.delete(queue)
        app.extensions["celery"].set_default()  # the session's app stays the default


# -- Apache Kafka on Heroku ----------------------------------------------------------------------


@pytest.fixture
def heroku_kafka_env(openssl, tmp_path) -> dict[str, str]:
    ca_cert, ca_key = make_cert(tmp_path, "heroku-kafka-ca")
    client_cert, client_key = make_cert(tmp_path, "client", ca=(ca_cert, ca_key))
    return {
        "KAFKA_URL": "kafka+ssl://ec2-3-1-2-3.compute-1.amazonaws.com:9096,"
                     "kafka+ssl://ec2-3-1-2-4.compute-1.amazonaws.com:9096/",
        "KAFKA_TRUSTED_CERT": ca_cert.read_text(),
        "KAFKA_CLIENT_CERT": client_cert.read_text(),
        "KAFKA_CLIENT_CERT_KEY": client_key.read_text(),
        "KAFKA_PREFIX": "acme.",
    }


@pytest.mark.processes  # openssl makes its certificates
def test_heroku_kafka_variables_become_librdkafka_settings(heroku_kafka_env):
    from confluent_kafka import Consumer, Producer

    env = heroku_kafka_env
    settings = kafka_client_settings(env)
    assert settings == {
        "bootstrap.servers": "ec2-3-1-2-3.compute-1.amazonaws.com:9096,"
                             "ec2-3-1-2-4.compute-1.amazonaws.com:9096",
        "security.protocol": "SSL",
        "ssl.ca.pem": env["KAFKA_TRUSTED_CERT"],
        "ssl.certificate.pem": env["KAFKA_CLIENT_CERT"],
        "ssl.key.pem": env["KAFKA_CLIENT_CERT_KEY"],
        "ssl.endpoint.identification.algorithm": "none",
    }
    # librdkafka takes every name and the PEM contents (it parses them at creation).
    Producer(settings).flush(0)
    Consumer({**settings, "group.id": consumer_group("g", env)}).close()
    # No PEM content in a log line.
    line = describe(settings)
    assert "BEGIN" not in line and "ssl.key.pem=***" in line and "ssl.ca.pem=***" in line

    # An explicit setting wins over a translated one; KAFKA_BOOTSTRAP_SERVERS over KAFKA_URL.
    explicit = kafka_client_settings({**env, "KAFKA_BOOTSTRAP_SERVERS": "b:9092",
                                "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                                "KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM": "https"})
    assert explicit["bootstrap.servers"] == "b:9092"
    assert explicit["security.protocol"] == "SASL_SSL"
    assert explicit["ssl.endpoint.identification.algorithm"] == "https"
    # A plaintext kafka:// URL (a private space's internal listener) sets no protocol.
    assert kafka_client_settings({"KAFKA_URL": "kafka://10.0.0.1:9092"}) == {
        "bootstrap.servers": "10.0.0.1:9092"}
    with pytest.raises(SystemExit, match="KAFKA_URL"):
        kafka_client_settings({})


@pytest.mark.processes  # openssl makes its certificates
def test_kafka_prefix_is_applied_to_topics_and_groups(heroku_kafka_env):
    env = {**heroku_kafka_env, "POIMEN_API_URL": "http://web", "POIMEN_API_TOKEN": "pmn_x",
           "DATABASE_URL": "postgres://u@h/d"}
    prefix = topic_prefix(env)
    assert prefix == "acme.poimen"
    assert dispatch_topic(prefix, "t1") == "acme.poimen.t1.dispatch"
    assert dead_letter_topic(prefix, "t1") == "acme.poimen.t1.dispatch.dlq"
    assert events_topic(prefix, "t1") == "acme.poimen.t1.events"
    assert topic_prefix({**env, "POIMEN_TOPIC_PREFIX": "runs"}) == "acme.runs"
    assert topic_prefix({}) == "poimen"

    inbox = inbox_settings(env)
    assert inbox.prefix == "acme.poimen" and inbox.group == "acme.poimen-inbox"
    assert inbox.kafka["security.protocol"] == "SSL"
    import re

    subscription = re.compile(inbox.subscription)
    assert subscription.match("acme.poimen.t1.dispatch")
    assert not subscription.match("poimen.t1.dispatch")
    assert not subscription.match("acme.poimen.t1.dispatch.dlq")
    assert inbox_settings({**env, "POIMEN_INBOX_GROUP": "blue"}).group == "acme.blue"
    # Already prefixed (as Heroku's docs write group names): not prefixed twice.
    assert inbox_settings({**env, "POIMEN_INBOX_GROUP": "acme.blue"}).group == "acme.blue"
    assert inbox_settings({k: v for k, v in env.items() if k != "KAFKA_PREFIX"}
                                ).group == "poimen-inbox"
    assert outbox_settings(env).prefix == "acme.poimen"
    assert consumer_group(REPLAY_GROUP, env) == "acme.poimen-dlq-replay"
