"""Workflows only the benchmarks use (``POIMEN_WORKFLOW_MODULES=bench.workflows``).

Running this file (``make bench`` runs every ``bench/*.py``) registers them and
does nothing else.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.registry import workflow  # noqa: E402

# The key-limit case of bench/execution.py: ``noop`` with a concurrency limit that
# never binds (a worker at --concurrency 2 runs at most 2 of a key's runs at once),
# so the difference from ``noop`` is what the rule costs (its locks, its count),
# not waiting.
KEYS = 16


@workflow("noop-keyed", version="1", concurrency_limit=100,
          concurrency_key=lambda input: input.get("key"))
def noop_keyed(ctx, input):
    return None
