"""``python -m benchmarks``: see :mod:`benchmarks.harness._cli`."""

from __future__ import annotations

import sys

from benchmarks.harness._cli import main

sys.exit(main())
