"""``poimen-dev up|down|status|env|run`` (also ``python -m poimen_dev``)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import down, environment, status, up
from .platform import run_platform


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="poimen-dev", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the embedded services the environment does not set")
    sub.add_parser("down", help="stop what `up` started")
    sub.add_parser("status", help="show the embedded services")
    sub.add_parser("env", help="print `export` lines for the embedded services")
    run = sub.add_parser("run", help="up, migrate, ensure the dev tenant, start the Procfile")
    run.add_argument("processes", nargs="*", help="Procfile processes (default: all but release)")
    args = parser.parse_args(argv)

    if args.command == "up":
        for name, url in up().items():
            print(f"{name}={url}")
    elif args.command == "down":
        down()
    elif args.command == "status":
        for service, state in status().items():
            print(f"{service:9} {state}")
    elif args.command == "env":
        for name, url in environment().items():
            print(f"export {name}={shlex.quote(url)}")
    elif args.command == "run":
        up()
        env = {**os.environ, **environment()}
        return run_platform(env, args.processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
