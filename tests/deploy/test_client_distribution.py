"""The Python client is a distribution of its own.

``pip install poimen`` would put ``app``, ``workers``, ``bridge`` and ``celeryconfig.py``
at the top of a team's site-packages (overwriting the team's own ``app/``, which
``pip uninstall poimen`` would then delete) and pull 45 packages for a client that needs
urllib3. The slow tests do what a team does, with the real pip in a fresh venv:
install ``clients/python`` alone next to a package named ``app`` and use it against
the real API; and ask pip for a wheel of the server, which is refused.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from tests.processes import ROOT

CLIENT = ROOT / "clients" / "python"
SERVER_TOP_LEVEL = ("app", "workers", "bridge", "poimen_dev", "celeryconfig", "lease",
                    "logconfig")


def client_version() -> str:
    return tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["version"]


def test_the_server_requires_the_client_of_its_own_checkout():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    assert f"poimen-client=={client_version()}" in requires
    # Every install of the server names where the client comes from: this checkout.
    assert "./clients/python" in (ROOT / "requirements.txt").read_text().splitlines()
    assert "./clients/python" in (ROOT / "Dockerfile").read_text()
    assert "-e ./clients/python" in (ROOT / "Makefile").read_text()


def test_the_client_imports_nothing_but_the_standard_library_and_urllib3():
    declared = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d.split(">")[0].split("=")[0] for d in declared] == ["urllib3"]
    for path in (CLIENT / "poimen_client").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ("urllib3", "__future__"), (
                    f"{path.relative_to(ROOT)} imports {name}")


def test_bridge_client_is_the_same_client():
    import poimen_client

    import bridge.client

    for name in poimen_client.__all__:
        assert getattr(bridge.client, name) is getattr(poimen_client, name), name
    assert poimen_client.__file__.startswith(str(CLIENT)), poimen_client.__file__


# -- with the real pip -------------------------------------------------------------------------


def _fresh_venv(path: Path, env: dict[str, str]):
    venv.create(path, with_pip=True)
    bin_dir = path / "bin"

    def run(*argv: str, cwd: Path, timeout: float = 300, ok: bool = True):
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if ok:
            assert proc.returncode == 0, (f"{' '.join(argv)}:\n{proc.stdout[-3000:]}"
                                          f"{proc.stderr[-3000:]}")
        return proc

    return bin_dir, run


def _clean_env(test_env: dict[str, str]) -> dict[str, str]:
    # Nothing of this checkout on the path: the fresh venv must stand on its own.
    return {k: v for k, v in test_env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.mark.slow
def test_a_team_installs_the_client_alone_next_to_its_own_app_package(
        test_env, tenant, live_api, tmp_path):
    # A copy of the client's files: building writes build/ and *.egg-info beside them.
    source = tmp_path / "client-src"
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info", "build", "dist"))
    env = _clean_env(test_env)
    bin_dir, run = _fresh_venv(tmp_path / "venv", env)

    # The team's project: its own package named app, the name Poimen's server uses.
    project = tmp_path / "team"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("WHOSE = 'the team'\n")
    run(str(bin_dir / "pip"), "install", "--quiet", str(source), cwd=project)
    run(str(bin_dir / "pip"), "check", cwd=project)

    # Installed: the client and urllib3, nothing else (pip and setuptools came with the venv).
    listed = json.loads(run(str(bin_dir / "pip"), "list", "--format=json", cwd=project).stdout)
    names = {d["name"].lower().replace("_", "-") for d in listed} - {"pip", "setuptools"}
    assert names == {"poimen-client", "urllib3"}, names

    # No server package in site-packages, and the team's app/ is the one imported.
    site = Path(run(str(bin_dir / "python"), "-c", "import sysconfig; "
                    "print(sysconfig.get_paths()['purelib'])", cwd=project).stdout.strip())
    clobbering = sorted(p.name for p in site.iterdir()
                        if p.name.removesuffix(".py") in SERVER_TOP_LEVEL)
    assert clobbering == [], clobbering
    script = (
        "import importlib.util, json, sys\n"
        "import app, poimen_client\n"
        "from poimen_client import Runs\n"
        "with Runs(sys.argv[1], sys.argv[2], retry_for=10) as runs:\n"
        "    run = runs.admit('echo', {'from': 'a fresh venv'}, dispatch_key=sys.argv[3])\n"
        "    again = runs.admit('echo', {'from': 'a fresh venv'}, dispatch_key=sys.argv[3])\n"
        "print(json.dumps({'app': app.WHOSE, 'client': poimen_client.__file__,\n"
        "    'server': [m for m in ('workers', 'bridge', 'celeryconfig', 'lease', 'logconfig')\n"
        "               if importlib.util.find_spec(m)],\n"
        "    'run': [run.id, run.replayed, again.id, again.replayed]}))\n")
    key = f"fresh-venv-{tmp_path.name}"
    seen = json.loads(run(str(bin_dir / "python"), "-c", script, live_api, tenant.token, key,
                          cwd=project).stdout)
    assert seen["app"] == "the team"
    assert seen["client"].startswith(str(site)), seen["client"]
    assert seen["server"] == []
    run_id, first_replayed, again_id, again_replayed = seen["run"]
    assert (first_replayed, again_id, again_replayed) == (False, run_id, True)

    # pip uninstall removes the client and leaves the team's files alone.
    run(str(bin_dir / "pip"), "uninstall", "--yes", "poimen-client", cwd=project)
    assert (project / "app" / "__init__.py").read_text() == "WHOSE = 'the team'\n"


@pytest.mark.slow
def test_a_wheel_of_the_server_is_refused_unless_the_environment_is_named_dedicated(
        test_env, tmp_path):
    # The server's build files only (pyproject, setup.cfg, the backend, the packages):
    # a copy, since a build writes build/ and *.egg-info beside them.
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    checkout = tmp_path / "checkout"
    for name in filter(None, tracked):
        if name.split("/")[0] in ("tests", "docs", "bench") or not (ROOT / name).is_file():
            continue
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, checkout / name)
    env = _clean_env(test_env)
    bin_dir, run = _fresh_venv(tmp_path / "venv", env)
    wheels = tmp_path / "wheels"

    refused = run(str(bin_dir / "pip"), "wheel", "--no-deps", "-w", str(wheels), str(checkout),
                  cwd=tmp_path, ok=False)
    assert refused.returncode != 0
    assert "NotForThisEnvironment" in refused.stderr + refused.stdout
    assert "clients/python" in refused.stderr + refused.stdout  # it says what to do instead
    assert not wheels.exists() or not list(wheels.glob("poimen-*.whl"))

    run(str(bin_dir / "pip"), "wheel", "--no-deps", "-w", str(wheels), "--config-settings",
        "poimen-environment=dedicated", str(checkout), cwd=tmp_path)
    assert [p.name for p in wheels.glob("poimen-*.whl")] == ["poimen-0.1.0-py3-none-any.whl"]
    assert os.path.getsize(next(wheels.glob("poimen-*.whl"))) > 0
