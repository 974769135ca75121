"""``python -m tierflow.cli``: the ``tierflow`` command, for when it is not on the PATH."""

from __future__ import annotations

import sys

from tierflow.cli.main import main

sys.exit(main())
