"""The Celery task names: one definition, used by the tasks, beat's schedule and the senders.

Names are part of the wire format (a message names its task), so they are
stable strings, never derived from function names: renaming code must not
orphan messages already queued.
"""

EXECUTE_RUN = "runs.execute"
REPAIR_RUNS = "runs.repair"

ALL = frozenset({EXECUTE_RUN, REPAIR_RUNS})
