"""What became of one delivery of a message: the value a delivery returns and a
partition settles."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class OutcomeKind(StrEnum):
    """What became of one delivery of a message."""

    ADMITTED = "admitted"            # 201: a new run
    REPLAYED = "replayed"            # 200: admission recognised the dispatch_key
    DEAD_LETTERED = "dead_lettered"  # a message fault, acknowledged by the dead-letter topic
    RETRY = "retry"                  # a delivery fault (or our own error, tries 1 and 2)


@dataclass
class Outcome:
    """What became of one delivery of a message, and why."""

    kind: OutcomeKind
    reason: str = ""
    status: int | None = None
    detail: str = ""
    derived_key: bool = False  # admitted under a derived kafka:... key

    @property
    def done(self) -> bool:
        """Whether the message is finished with, so its offset may be committed."""
        return self.kind is not OutcomeKind.RETRY
