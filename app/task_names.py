"""The Celery task names: one definition, used by the tasks, beat's schedule and the senders.

Names are part of the wire format (a message names its task), so they are
stable strings, never derived from function names: renaming code must not
orphan messages already queued.
"""

EXECUTE_RUN = "runs.execute"
REPAIR_RUNS = "runs.repair"

ALL = frozenset({EXECUTE_RUN, REPAIR_RUNS})


def execute_shadow(workflow_ref: str) -> str:
    """The name a run's message shows (Flower, logs): ``runs.execute[<workflow_ref>]``."""
    return f"{EXECUTE_RUN}[{workflow_ref}]"


def ref_of_shadow(shadow: str | None) -> str | None:
    """The workflow ref ``execute_shadow`` put in a message's name, or None."""
    prefix = f"{EXECUTE_RUN}["
    if not shadow or not shadow.startswith(prefix) or not shadow.endswith("]"):
        return None
    return shadow[len(prefix):-1]
