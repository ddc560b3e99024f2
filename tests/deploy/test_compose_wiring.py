"""The container path is wired to the Procfile .

No image is built here (no Docker on the test machines). What is checked is what
would make the image run something other than the Procfile: every Procfile entry
is a compose service of the one image, whose command is the entry's name; the
image's entrypoint, executed for real by ``/bin/sh``, runs exactly the Procfile's
command for each name (the programs themselves are stand-ins that print their
arguments: the real ones are not what this test is about).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from poimen_dev.platform import procfile_commands
from tests.processes import ROOT

ENTRYPOINT = ROOT / "bin" / "docker-entrypoint"


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_every_procfile_entry_is_a_compose_service_of_the_one_image():
    services = compose()["services"]
    for name in procfile_commands():
        assert name in services, f"Procfile entry {name!r} is not a service in compose.yaml"
        service = services[name]
        assert service.get("build") == ".", f"{name} is not built from this repository"
        assert service.get("command") == [name], f"{name}: command {service.get('command')}"
        assert "entrypoint" not in service, f"{name} overrides the image's entrypoint"
    # One image: every app service has the same build and image name.
    images = {services[n].get("image") for n in procfile_commands()}
    assert len(images) == 1, images
    # Backing services are a Postgres, a Redis and a Kafka-protocol broker.
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")
    assert services["kafka"]["image"].startswith(("apache/kafka:", "redpandadata/",
                                                  "docker.redpanda.com/"))


def test_long_running_services_get_the_shutdown_grace_before_sigkill():
    services = compose()["services"]
    for name in procfile_commands():
        if name == "release":
            continue
        grace = services[name].get("stop_grace_period", "10s")
        seconds = int(re.fullmatch(r"(\d+)s", grace).group(1))
        assert seconds > 25, f"{name}: stop_grace_period {grace} cuts POIMEN_SHUTDOWN_GRACE (25 s)"


def test_the_dockerfile_builds_one_image_from_requirements_on_the_pinned_python():
    text = dockerfile()
    version = (ROOT / ".python-version").read_text().strip()
    assert re.search(rf"^FROM python:{re.escape(version)}[.-]", text, re.M), (
        f"the image's Python is not .python-version ({version})")
    assert "requirements.txt" in text
    assert re.search(r'^ENTRYPOINT \["/app/bin/docker-entrypoint"\]', text, re.M)
    assert len(re.findall(r"^FROM ", text, re.M)) == 1
    assert re.search(r"^USER (?!root)\S+", text, re.M), "the processes run as root"
    assert os.access(ENTRYPOINT, os.X_OK)


def _argv_through(argv: list[str], tmp_path: Path, env: dict[str, str]) -> list[str]:
    """Run ``argv`` with stand-ins for the Procfile's programs; return what they were given."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for program in ("gunicorn", "celery", "flask", "python"):
        stub = stubs / program
        stub.write_text('#!/bin/sh\nprintf "%s\\n" "$(basename "$0")" "$@"\n')
        stub.chmod(0o755)
    proc = subprocess.run(argv, env={**env, "PATH": f"{stubs}:/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.processes
def test_the_entrypoint_runs_each_procfile_command_as_written(tmp_path):
    env = {"PORT": "8123", "WEB_CONCURRENCY": "3", "WORKER_CONCURRENCY": "5"}
    for name, command in procfile_commands().items():
        expected = _argv_through(["/bin/sh", "-c", f"exec {command}"], tmp_path, env)
        actual = _argv_through([str(ENTRYPOINT), name], tmp_path, env)
        assert actual == expected, name
        assert actual[0] == command.split()[0]
    # The settings reach the command (the shell expands the Procfile's defaults).
    web = _argv_through([str(ENTRYPOINT), "web"], tmp_path, env)
    assert "0.0.0.0:8123" in web and "3" in web
    # Anything else is run as a command: one-off operator commands in the image.
    assert _argv_through([str(ENTRYPOINT), "flask", "--app", "app", "tenants", "list"],
                         tmp_path, env) == ["flask", "--app", "app", "tenants", "list"]


def test_app_json_declares_the_add_ons_and_every_long_running_process():
    import json

    manifest = json.loads((ROOT / "app.json").read_text())
    plans = {addon["plan"].split(":")[0] for addon in manifest["addons"]}
    assert {"heroku-postgresql", "heroku-redis", "heroku-kafka"} <= plans
    assert set(manifest["formation"]) == set(procfile_commands()) - {"release"}
    # Heroku's Redis certificate is self-signed: without this, rediss:// is refused.
    assert manifest["env"]["POIMEN_REDIS_SSL_CERT_REQS"]["value"] == "none"
    # A one-click deploy's console works: Heroku generates the cookie secret (64 hex
    # characters, over the console's 32), and web's process count is the budget's.
    assert manifest["env"]["POIMEN_CONSOLE_SECRET"]["generator"] == "secret"
    assert manifest["env"]["WEB_CONCURRENCY"]["value"] == "2"
    # The release phase is the Procfile's, run by Heroku before every deploy.
    assert procfile_commands()["release"] == "flask --app app db upgrade"


@pytest.mark.processes
def test_make_refreshes_empty_package_lists_before_giving_up_on_a_package():
    """A fresh machine's apt lists may be empty: `apt-get install` alone then fails and the
    console's browser tests skip. `make -n` shows what make would run."""
    import subprocess

    for target, package in (("test", "chromium chromium-driver"), ("bench", "wrk")):
        recipe = subprocess.run(["make", "-n", "-W", "setup.cfg", target], cwd=ROOT,
                                capture_output=True, text=True, timeout=60).stdout
        assert f"apt-get update && apt-get install -y {package}" in recipe, (target, recipe)
