"""The server's build backend: setuptools, refusing to build a wheel for an unnamed environment.

Poimen's server installs top-level packages named ``app``, ``workers`` and ``bridge``
and modules ``celeryconfig``, ``lease`` and ``logconfig`` (renaming them is out of
scope). Installed as a wheel into a team's own environment, they would overwrite the
team's ``app/`` package, and ``pip uninstall poimen`` would delete it. So a
wheel is built only for an environment that is Poimen's own, said in so many words:
``--config-settings poimen-environment=dedicated`` (requirements.txt says it for
Heroku's slug, the Dockerfile for the image). ``make install`` installs editable,
from the checkout, which puts none of the server's packages into site-packages (an
editable build is not refused). A team that wants to start runs from its own code
installs ``poimen-client`` (``clients/python``) instead.

Its ``build_py`` (``BuildPy``, named by setup.cfg's ``cmdclass``) also puts the
checkout's Alembic migrations into the wheel, so an installed wheel migrates with
no checkout beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every other hook is setuptools' own
from setuptools.command.build_py import build_py as _build_py

SETTING = "poimen-environment"
DEDICATED = "dedicated"

REFUSAL = f"""
poimen (the server) is not a library to install into another project's environment:
its top-level packages are named app, workers and bridge (and celeryconfig, lease,
logconfig), and a wheel of it would overwrite a package of yours with the same name
(and `pip uninstall poimen` would delete it).

  * To start or watch runs from your code, install the client alone:
        pip install <poimen checkout>/clients/python        (poimen-client, urllib3 only)
  * To run Poimen, deploy it from its checkout: `make run`, the Dockerfile, or Heroku
    (requirements.txt); see docs/operations/deploy.md.
  * To build the server's wheel for an environment that is Poimen's alone (an image,
    a dedicated virtualenv), say so:
        pip install --config-settings {SETTING}={DEDICATED} <poimen checkout>
"""


class NotForThisEnvironment(RuntimeError):
    """A wheel of the server was asked for without naming a dedicated environment."""


def _dedicated(config_settings: dict[str, Any] | None) -> dict[str, Any] | None:
    settings = dict(config_settings or {})
    if settings.pop(SETTING, None) != DEDICATED:
        raise NotForThisEnvironment(REFUSAL)
    return settings or None


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(_dedicated(config_settings))


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory,
                                                        _dedicated(config_settings))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _setuptools.build_wheel(wheel_directory, _dedicated(config_settings),
                                   metadata_directory)


# The Alembic scripts, as the checkout keeps them (``migrations/``), and where the
# wheel carries them: inside the ``app`` package, which ``create_app`` looks in first.
MIGRATIONS = "migrations"
SHIPPED_MIGRATIONS = ("app", "migrations")


class BuildPy(_build_py):
    """setuptools' ``build_py``, plus the checkout's ``migrations/`` as ``app/migrations/``.

    The release step (``flask --app app db upgrade``) of an installed wheel has no
    checkout beside it; Alembic reads its scripts from a directory, so the wheel
    carries a copy. An editable install copies nothing: the checkout's own are used.
    """

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib, *SHIPPED_MIGRATIONS)
        for source in sorted(Path(MIGRATIONS).rglob("*")):
            if source.is_file() and "__pycache__" not in source.parts and source.suffix != ".pyc":
                dest = target / source.relative_to(MIGRATIONS)
                self.mkpath(str(dest.parent))
                self.copy_file(str(source), str(dest))
