"""``python -m bridge.inbox``: run the inbox until SIGTERM or SIGINT (the Procfile's ``inbox``)."""

import sys

from .relay import main

sys.exit(main())
