"""The worker program of the launcher's tests: tests/children/cli.py, and its ``ready`` line.

The tests in ``tests/cli/`` run it through ``aioelastic-run`` as a plain script; a worker
that must be there before the test signals anyone prints ``ready rank=R pid=P`` (with
``child=C`` when it started a child of its own).
"""

from __future__ import annotations

import re

from tests.support.paths import CHILDREN

#: ``tests/children/cli.py``, as ``aioelastic-run`` is given it.
SCRIPT = str(CHILDREN / "cli.py")
#: A worker's ``ready`` line: its rank, its pid and, if it started one, its child's pid.
READY = re.compile(r"ready rank=(\d+) pid=(\d+)(?: child=(\d+))?")
