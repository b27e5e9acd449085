"""A fork-server preload whose interpreter teardown blocks (like finalising torch).

Its ``atexit`` handler blocks reading a pipe nobody writes to: a server that finalised
its interpreter on the way out would never exit by itself.
"""

from __future__ import annotations

import atexit
import os

_never_r, _never_w = os.pipe()
atexit.register(os.read, _never_r, 1)
