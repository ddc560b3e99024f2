"""What ``promtool check metrics`` checks, for an exposition in Prometheus' text format.

promtool is a Go binary of the Prometheus server: no PyPI wheel or npm package
ships it and the machine reaches no other source, so the tests check the same
rules here (client_golang's ``testutil/promlint``, which ``promtool check
metrics`` runs), after prometheus_client's strict parsers accepted the text.
"""

from __future__ import annotations

import re

NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# promlint: "use base unit" -- these suffixes name a unit that is not a base unit.
NON_BASE_UNITS = ("milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "days",
                  "weeks", "kilobytes", "megabytes", "gigabytes", "terabytes", "kilometers",
                  "millimeters", "centimeters", "percent", "celsius", "fahrenheit")
RESERVED_SUFFIXES = ("_count", "_sum", "_bucket", "_total", "_created")


def lint(text: str) -> list[str]:
    """The problems promtool would report for ``text`` (empty: none)."""
    from prometheus_client.parser import text_string_to_metric_families

    problems = []
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.MULTILINE))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for family in text_string_to_metric_families(text):
        name = family.name
        exposed = name + "_total" if family.type == "counter" else name
        if not NAME.match(exposed) or ":" in exposed:
            problems.append(f"{exposed}: not a valid metric name (colons are for rules)")
        if exposed != exposed.lower():
            problems.append(f"{exposed}: metric names should be written in snake_case")
        if exposed not in helps:
            problems.append(f"{exposed}: no help text")
        if exposed not in types:
            problems.append(f"{exposed}: no TYPE line")
        if family.type == "counter" and not exposed.endswith("_total"):
            problems.append(f"{exposed}: counter metrics should have \"_total\" suffix")
        if family.type != "counter" and exposed.endswith(RESERVED_SUFFIXES):
            problems.append(f"{exposed}: non-counter metrics should not have a reserved suffix")
        for unit in NON_BASE_UNITS:
            if re.search(rf"(^|_){unit}(_|$)", exposed):
                problems.append(f"{exposed}: use base unit, not {unit}")
        for sample in family.samples:
            for label in sample.labels:
                if not LABEL.match(label) or label != label.lower():
                    problems.append(f"{exposed}: label {label!r} is not snake_case")
                if label == "le" and family.type != "histogram" or \
                        label == "quantile" and family.type != "summary":
                    problems.append(f"{exposed}: reserved label {label!r}")
    return problems


def parse_openmetrics(text: str) -> list:
    """Families of an OpenMetrics exposition (its parser is stricter: it raises on any fault)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))
