"""``python -m benchmarks``: see :mod:`benchmarks._cli`."""

from __future__ import annotations

import sys

from benchmarks._cli import main

sys.exit(main())
