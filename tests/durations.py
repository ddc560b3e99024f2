"""Longest modules first: the system lane's order, from ``tests/durations.json``.

The system lane runs whole modules per xdist worker (``--dist loadfile``), handed out in
collection order as workers free up. A long module handed out last keeps one worker busy
while the others idle, so the lane starts the longest modules first (the greedy
longest-processing-time order): ``tests/durations.json`` holds each system module's
seconds from a run (``python -m tests.lanes system --store-durations`` writes them),
and a module it does not know yet is taken for the longest, so it starts early.

Active where ``POIMEN_LONGEST_FIRST`` is set (``tests/lanes.py`` sets it for the system
pass, which also turns off xdist's own reordering by test count).
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

FILE = Path(__file__).with_name("durations.json")
ROOT = FILE.parent.parent


def recorded() -> dict[str, float]:
    return json.loads(FILE.read_text()) if FILE.exists() else {}


def order(modules: list[str], seconds: dict[str, float]) -> list[str]:
    """``modules`` longest first; unknown ones before every known one; ties as given."""
    unknown = float("inf")
    return sorted(modules, key=lambda m: -seconds.get(m, unknown))


def of_junit(path: Path) -> dict[str, float]:
    """Each module's seconds in a pytest JUnit XML report (``--junitxml``)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        # classname is ``tests.chaos.test_x`` (or ``tests.chaos.test_x.TestClass``)
        module = case.get("classname", "").replace(".", "/")
        while not (ROOT / f"{module}.py").exists() and "/" in module:
            module = module.rsplit("/", 1)[0]
        totals[module + ".py"] += float(case.get("time", 0))
    return {m: round(s, 1) for m, s in totals.items()}


def store(reports: list[Path]) -> None:
    """Merge the reports' module times into ``tests/durations.json``."""
    seconds = recorded()
    for report in reports:
        if report.exists():
            seconds.update(of_junit(report))
    FILE.write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not os.environ.get("POIMEN_LONGEST_FIRST"):
        return
    seconds = recorded()
    by_module: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_module[item.nodeid.split("::", 1)[0]].append(item)
    items[:] = [item for module in order(list(by_module), seconds) for item in by_module[module]]
