"""Celery settings a team sets in a workflow module (``tests/app/test_wire_fidelity.py``).

Loaded as ``POIMEN_WORKFLOW_MODULES=tests.workflows,tests.workflows.team_settings`` with
``POIMEN_TEST_TEAM_SETTING`` naming one of ``SETTINGS`` (and, for ``signed``,
``POIMEN_TEST_SIGNING_DIR`` a folder made by ``make_signing_files``): on import it changes
the process's Celery app as a team's module would, in the web process and the worker alike.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from celery import current_app, signals

ROUTED_QUEUE_SUFFIX = "-team-routed"


def routed_queue(default_queue: str) -> str:
    """The queue ``task_routes`` sends ``runs.execute`` to (the worker consumes it too)."""
    return default_queue + ROUTED_QUEUE_SUFFIX


def route_runs(name, args, kwargs, options, task=None, **_):
    """A router function: ``runs.execute`` to the routed queue, everything else as it was."""
    if name == "runs.execute":
        return {"queue": routed_queue(current_app.conf.task_default_queue)}
    return None


def _seen(**_):
    """A ``before_task_publish`` receiver (OpenTelemetry's instrumentation is one)."""


def make_signing_files(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway RSA key and self-signed certificate: ``(key, cert, store folder)``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    folder = Path(folder)
    store = folder / "store"
    store.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "poimen-test-signer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    key_path, cert_path = folder / "signer.key", folder / "signer.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (store / "signer.pem").write_bytes(cert_path.read_bytes())
    return key_path, cert_path, store


def _signed(app, signing_dir: str | None) -> None:
    folder = Path(signing_dir) if signing_dir else None
    if folder is None or not (folder / "signer.key").exists():
        raise RuntimeError("the signed setting needs POIMEN_TEST_SIGNING_DIR "
                           "(a folder of make_signing_files)")
    app.conf.update(task_serializer="auth", accept_content=["auth"], result_accept_content=["json"],
                    security_key=str(folder / "signer.key"),
                    security_certificate=str(folder / "signer.pem"),
                    security_cert_store=str(folder / "store"))
    app.setup_security(allowed_serializers=["json"], serializer="json")


# A setting's name -> what a team's module does with the Celery app.
SETTINGS = {
    "msgpack": lambda app, _: app.conf.update(task_serializer="msgpack",
                                              accept_content=["msgpack"]),
    "gzip": lambda app, _: app.conf.update(task_compression="gzip"),
    "routes": lambda app, _: app.conf.update(task_routes={
        "runs.execute": {"queue": routed_queue(app.conf.task_default_queue)}}),
    "router": lambda app, _: app.conf.update(task_routes=(route_runs,)),
    "annotations": lambda app, _: app.conf.update(
        task_annotations={"runs.execute": {"priority": 5}}),
    "default-priority": lambda app, _: app.conf.update(task_default_priority=4),
    "publish-signal": lambda app, _: signals.before_task_publish.connect(_seen, weak=False),
    "signed": _signed,
}

_setting = os.environ.get("POIMEN_TEST_TEAM_SETTING")
if _setting:
    SETTINGS[_setting](current_app, os.environ.get("POIMEN_TEST_SIGNING_DIR"))
