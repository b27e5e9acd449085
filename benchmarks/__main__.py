"""``python -m benchmarks``: the harness's command line over every measure of the suite."""

from __future__ import annotations

import sys

from benchmarks.harness._cli import main
from benchmarks.measures import all_measures

sys.exit(main(all_measures()))
