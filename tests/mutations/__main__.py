"""``python -m tests.mutations [--ci] [--jobs N] [NAME ...]``: run the mutation gate.

Needs the test services' environment (``make mutations`` provides it). For each
mutant: copy the tree (tracked and untracked, not ignored files) to a scratch
directory, apply the edit there, run its tests, and record whether they failed
(killed) or passed (survived). Prints mutant -> verdict -> killing test ->
seconds, in the catalogue's order; exits 1 if any mutant survived, is stale, or is
invalid (its tests failed only because the mutant does not run: bad SQL, bad Python),
0 otherwise.
A mutant whose every test skipped (a service this machine lacks, e.g. RabbitMQ)
gets no verdict: SKIPPED, reported on stderr, not counted as killed.

``--jobs N`` mutants run at once (default :data:`JOBS`): each in its own scratch copy,
its pytest a session of its own with its scratch database and the Celery queue named
after it (``tests/conftest.py``), so they share nothing but the servers. Most of a
mutant's time is its tests waiting on processes, so more mutants than cores run at once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
JOBS = (os.cpu_count() or 1) + 1
# A mutant whose tests include this one runs for minutes: it starts first.
SLOW = "tests/test_cross_feature_model.py"


def tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p and (ROOT / p).is_file()]


def copy_tree(dest: Path, files: list[str]) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    # The scratch copy uses this checkout's virtualenv (its console scripts run the
    # scratch code: the tests start processes with PYTHONPATH = the scratch root).
    (dest / ".venv").symlink_to(ROOT / ".venv")


def apply(mutant: Mutant, dest: Path) -> str | None:
    """Apply the edits; return why one could not be applied (a stale mutant), or None."""
    for rel, find, replace, occurrences, chosen in mutant.edits():
        path = dest / rel
        text = path.read_text()
        starts, at = [], text.find(find)
        while at != -1:
            starts.append(at)
            at = text.find(find, at + len(find))
        if len(starts) != occurrences or not chosen or not set(chosen) <= set(
                range(1, occurrences + 1)):
            return (f"expected {occurrences} occurrence(s) in {rel}, found {len(starts)}: "
                    f"{find[:60]!r}")
        for nth in sorted(chosen, reverse=True):
            start = starts[nth - 1]
            text = text[:start] + replace + text[start + len(find):]
        path.write_text(text)
    return None


# A kill by one of these is the mutant failing to run (bad SQL, bad Python), not the
# witness catching a broken rule: the gate reports such a mutant INVALID and fails.
CRASH = re.compile(r"\b(SyntaxError|IndentationError|NameError|ImportError|"
                   r"ModuleNotFoundError|ProgrammingError|AmbiguousParameter|"
                   r"UndefinedColumn|UndefinedFunction|UndefinedTable|"
                   r"DatatypeMismatch|IndeterminateDatatype)\b")


def run_one(mutant: Mutant, files: list[str], timeout: float) -> tuple[str, str, float]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"poimen-mutant-{mutant.name}-") as tmp:
        dest = Path(tmp)
        copy_tree(dest, files)
        stale = apply(mutant, dest)
        if stale:
            return "STALE", stale, time.monotonic() - started
        env = {**os.environ, "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1",
               "COLUMNS": "1000",  # summary lines uncut: the gate reads why a test failed
               # The cross-feature model test searches at random: six times make test's
               # budget here, so a mutant it can find is found in every gate run.
               "POIMEN_MODEL_EXAMPLES": os.environ.get("POIMEN_MODEL_EXAMPLES", "300")}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider",
                 "-o", "addopts=", *mutant.tests],
                cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "KILLED", "timeout (the tests hung on the mutant)", time.monotonic() - started
    elapsed = time.monotonic() - started
    if proc.returncode == 1:
        failed = re.findall(r"^FAILED (.+?)(?: - (.*))?$", proc.stdout, re.M)
        if not failed:
            return "KILLED", "(a test failed)", elapsed
        test, why = failed[0]
        if CRASH.search(why or ""):
            # A mutant that does not even run proves nothing about the witness.
            return "INVALID", f"{test} crashed on the mutant: {why[:160]}", elapsed
        return "KILLED", test, elapsed
    if proc.returncode == 0:
        summary = proc.stdout.strip().splitlines()[-1:] or [""]
        if "skipped" in summary[0] and "passed" not in summary[0]:
            # Its tests need a service this machine lacks (RabbitMQ): no verdict either way.
            return "SKIPPED", f"every selected test skipped: {summary[0]}", elapsed
        return "SURVIVED", "every selected test passed", elapsed
    # 2-5: interrupted, internal error, usage error, no tests: the gate is broken.
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return "ERROR", f"pytest exit {proc.returncode}: {' | '.join(tail)}", elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations")
    parser.add_argument("names", nargs="*", help="only these mutants")
    parser.add_argument("--ci", action="store_true", help="only the CI subset")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--jobs", "-j", type=int, default=JOBS,
                        help=f"mutants run at once (default {JOBS}: the cores, plus one)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if (not args.names or m.name in args.names)
              and (not args.ci or m.ci)]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    files = tree_files()
    jobs = max(1, args.jobs)
    print(f"mutation gate: {len(chosen)} mutant(s), scratch copies of {len(files)} files, "
          f"{jobs} at a time", flush=True)
    started = time.monotonic()
    results = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        # The longest first (the model test searches for minutes), so none is left running
        # alone at the end; the report keeps the catalogue's order.
        started_in = sorted(chosen, key=lambda m: not any(SLOW in t for t in m.tests))
        futures = {m.name: pool.submit(run_one, m, files, args.timeout) for m in started_in}
        running = [futures[m.name] for m in chosen]
        # Reported in the catalogue's order, each as soon as it and those before it end.
        for i, (mutant, future) in enumerate(zip(chosen, running, strict=True), 1):
            verdict, detail, seconds = future.result()
            results.append((mutant, verdict, detail, seconds))
            print(f"[{i}/{len(chosen)}] {mutant.name:<40} {verdict:<8} {seconds:6.1f}s  "
                  f"{detail}", flush=True)
    skipped = [r for r in results if r[1] == "SKIPPED"]
    bad = [r for r in results if r[1] not in ("KILLED", "SKIPPED")]
    print(f"\n{len(results) - len(bad) - len(skipped)} of {len(results)} mutants killed "
          f"in {time.monotonic() - started:.0f}s ({sum(r[3] for r in results):.0f}s of "
          f"mutants, {jobs} at a time)", flush=True)
    for mutant, _, detail, _ in skipped:
        print(f"  SKIPPED (no verdict, its service is missing): {mutant.name}: {detail}",
              file=sys.stderr, flush=True)
    for mutant, verdict, detail, _ in bad:
        print(f"  {verdict}: {mutant.name} ({mutant.rule}): {detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
