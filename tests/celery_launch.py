"""``python -m tests.celery_launch worker|beat ARG ...``: what ``celery -A workers worker|beat
ARG ...`` runs, without the ``celery`` program's plugin search.

Before it reads its arguments, the ``celery`` program imports every installed
``celery.commands`` plugin (Flower, with Tornado), click-repl and prompt_toolkit: 0.2-0.3 s
of CPU per start, and the system tests start about 250 workers and beats on two
cores. This runs Celery's own ``worker`` and ``beat`` commands with the context the
``celery`` group gives them for ``-A workers``: the app ``find_app`` finds, the group's
``CELERY_`` environment prefix, Celery's exit status. The group's other work is for
options the tests do not pass (``--broker``, ``--config``, ``--workdir`` ...) or for
user and preload options, which Poimen declares none of: this refuses to start if it
ever does, so the two cannot drift apart silently.

The Procfile's own commands stay covered as written: the deploy tests run them
(``tests/deploy``), ``tests/workers/test_celery_native.py`` runs the ``celery`` program
for the operators' commands, and ``tests/test_celery_launch.py`` holds this launcher and
the ``celery`` program to the same options (their ``--help``, word for word).
"""

from __future__ import annotations

import os
import sys

COMMANDS = ("worker", "beat")


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: python -m tests.celery_launch {'|'.join(COMMANDS)} ARG ...")
    name, args = argv[0], argv[1:]

    from celery.app.utils import find_app
    from celery.bin.base import CLIContext

    if name == "worker":
        from celery.bin.worker import worker as command
    else:
        from celery.bin.beat import beat as command

    app = find_app("workers")
    declared = {kind: opts for kind, opts in app.user_options.items() if opts}
    if declared:
        sys.exit(f"the app declares Celery user options {sorted(declared)}: start it with "
                 "the celery program, which adds them")
    no_color = os.environ.get("CELERY_NO_COLOR", "").lower() in ("1", "true", "yes", "on")
    command.main(args=args, prog_name=f"celery {name}", auto_envvar_prefix=f"CELERY_{name.upper()}",
                 obj=CLIContext(app=app, no_color=no_color or None, workdir=None, quiet=False))


if __name__ == "__main__":
    main(sys.argv[1:])
