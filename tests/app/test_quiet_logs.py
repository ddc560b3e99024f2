"""Logs never carry run inputs or secrets.

SQLAlchemy puts statement parameters (whole run inputs) into exception messages,
and Postgres quotes the values it refuses (``Failing row contains (...)``), so
the API's unhandled-error log line keeps types and the stack, not messages.
Kafka client settings printed at start hide credentials.
"""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

SECRET = "sk-live-4f9a1c2e7b"


def test_database_errors_do_not_carry_statement_parameters(db_session):
    with pytest.raises(sa_exc.DBAPIError) as caught:
        db_session.execute(text("SELECT CAST(:input AS text), 1 / 0"),
                           {"input": f'{{"api_key": "{SECRET}"}}'})
    db_session.rollback()
    assert SECRET not in str(caught.value)
    assert "parameters hidden" in str(caught.value)


def test_an_error_quoting_the_input_is_logged_without_it(app, client, tx_tenant, monkeypatch,
                                                          caplog):
    """A real refusal by Postgres whose message repeats the whole row, input included."""
    from app.state import runs

    # The admission statement with a status the check constraint refuses.
    monkeypatch.setattr(runs, "ADMIT",
                        text(runs.ADMIT.text.replace("'queued'", "'bogus'", 1)))
    caplog.set_level(logging.INFO)
    response = client.post("/v1/runs", headers=tx_tenant.headers, json={
        "workflow_ref": "echo", "input": {"api_key": SECRET}, "dispatch_key": "k"})
    assert response.status_code == 500
    assert response.json["error"]["code"] == "internal_error"
    assert SECRET not in response.get_data(as_text=True)
    logged = caplog.text
    assert SECRET not in logged, logged
    # The stack is kept, in the record's fields (docs/operations/metrics.md#logs), not its message.
    record = next(r for r in caplog.records if r.getMessage().startswith("unhandled error"))
    assert "SQLSTATE 23514" in record.traceback and "create_run" in record.traceback
    assert record.exc_type.endswith("IntegrityError") and SECRET not in record.traceback
    assert "Traceback" not in record.getMessage()


def test_an_exception_message_with_the_input_is_not_logged(client, tx_tenant, monkeypatch,
                                                            caplog):
    from app import admission_handler

    def broken(session, **fields):
        raise KeyError(f"no account for {fields['input']}")

    monkeypatch.setattr(admission_handler, "admit_run", broken)
    caplog.set_level(logging.INFO)
    response = client.post("/v1/runs", headers=tx_tenant.headers,
                           json={"workflow_ref": "echo", "input": {"password": SECRET}})
    assert response.status_code == 500
    assert SECRET not in caplog.text, caplog.text
    assert "builtins.KeyError" in caplog.text


def test_kafka_settings_printed_at_start_hide_credentials():
    """The inbox and outbox log their Kafka settings through ``describe`` when they start."""
    from bridge.kafka import describe
    from poimenconfig import kafka_client_settings

    env = {
        "KAFKA_BOOTSTRAP_SERVERS": "broker-1:9096",
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "KAFKA_SASL_USERNAME": "poimen",
        "KAFKA_SASL_PASSWORD": SECRET + "-sasl",
        "KAFKA_SSL_KEY_PASSWORD": SECRET + "-key",
        "KAFKA_SSL_KEYSTORE_PASSWORD": SECRET + "-keystore",
        "KAFKA_SSL_KEY_PEM": SECRET + "-pem",
        "KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET": SECRET + "-oauth",
    }
    line = describe(kafka_client_settings(env))
    assert SECRET not in line, line
    for name in ("sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem",
                 "sasl.oauthbearer.client.secret"):
        assert f"{name}=***" in line
    # What is not a credential stays readable for the operator.
    assert "bootstrap.servers=broker-1:9096" in line
    assert "security.protocol=SASL_SSL" in line and "sasl.username=poimen" in line
