"""A module to ``--preload`` that says when it is imported: ``preloaded pid=<pid>`` on stdout.

The fork server inherits the launcher's stdout, so the line reaches the test as soon as
the server has imported it.
"""

from __future__ import annotations

import os

print(f"preloaded pid={os.getpid()}", flush=True)
