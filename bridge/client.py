"""The Python client, re-exported: it lives in its own distribution, ``poimen-client``
(``clients/python/poimen_client``), which the server depends on.

``from bridge.client import Runs`` keeps working for code written before the split;
new code imports ``poimen_client``.
"""

from poimen_client import *  # noqa: F403 - the client's public names, unchanged
from poimen_client import __all__  # noqa: F401
