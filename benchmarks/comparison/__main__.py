"""``python -m benchmarks.comparison``: see :mod:`benchmarks.comparison.run`."""

import sys

from benchmarks.comparison.run import main

sys.exit(main())
