"""The workflow registry: named, versioned workflows that runs execute.

A workflow is registered with ``@workflow("name", version="1")`` on a function
``(ctx, input) -> JSON result``. The web process uses the registry to validate
``workflow_ref`` and pin the version at admission; the worker uses it to find
the code to run.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

BUILTIN_MODULES = ("workers.examples",)
REF_PATTERN = re.compile(r"^(?P<name>[A-Za-z0-9_.:-]{1,200})(?:@(?P<version>[A-Za-z0-9_.-]{1,64}))?$")


class UnknownWorkflow(LookupError):
    """``workflow_ref`` names no registered workflow (or no such version)."""


@dataclass(frozen=True)
class Workflow:
    name: str
    version: str
    fn: Callable[..., Any]
    max_attempts: int = 1
    # Lost workers (OOM, segfault, kill -9) a run may outlive; then it fails worker_lost.
    max_takeovers: int = 5
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    retry_on: tuple[type[BaseException], ...] = field(default=(Exception,))

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def retry_delay(self, attempt: int) -> float:
        """Return the delay before attempt ``attempt + 1`` (capped exponential)."""
        return min(self.backoff_max_seconds, self.backoff_seconds * (2 ** max(0, attempt - 1)))


_registry: dict[str, dict[str, Workflow]] = {}


def workflow(
    name: str,
    version: str = "1",
    *,
    max_attempts: int = 1,
    max_takeovers: int = 5,
    backoff_seconds: float = 1.0,
    backoff_max_seconds: float = 60.0,
    retry_on: Iterable[type[BaseException]] = (Exception,),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated ``(ctx, input)`` function as workflow ``name@version``."""
    if not REF_PATTERN.match(f"{name}@{version}"):
        raise ValueError(f"invalid workflow name or version: {name!r}@{version!r}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _registry.setdefault(name, {})[version] = Workflow(
            name=name,
            version=version,
            fn=fn,
            max_attempts=max(1, max_attempts),
            max_takeovers=max(0, max_takeovers),
            backoff_seconds=backoff_seconds,
            backoff_max_seconds=backoff_max_seconds,
            retry_on=tuple(retry_on),
        )
        return fn

    return register


def _version_key(version: str) -> tuple:
    # Natural order, so "10" is newer than "9" and "1.10" newer than "1.9".
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.-]", version))


def resolve(ref: str) -> Workflow:
    """Return the workflow ``ref`` names; a bare name means its newest version."""
    match = REF_PATTERN.match(ref)
    if not match:
        raise UnknownWorkflow(f"malformed workflow_ref {ref!r}; expected 'name' or 'name@version'")
    versions = _registry.get(match["name"])
    if not versions:
        raise UnknownWorkflow(f"no workflow named {match['name']!r} is registered")
    version = match["version"]
    if version is None:
        return versions[max(versions, key=_version_key)]
    if version not in versions:
        raise UnknownWorkflow(
            f"workflow {match['name']!r} has no version {version!r} "
            f"(registered: {', '.join(sorted(versions, key=_version_key))})"
        )
    return versions[version]


def get(name: str, version: str) -> Workflow:
    """Return the exact pinned workflow a run was admitted with."""
    return resolve(f"{name}@{version}")


def registered() -> list[Workflow]:
    """Return every registered workflow version."""
    return [wf for versions in _registry.values() for wf in versions.values()]


def load_modules(modules: Iterable[str]) -> None:
    """Import the built-in examples and each module in ``modules`` (they register on import)."""
    for module in (*BUILTIN_MODULES, *modules):
        importlib.import_module(module)
