"""A fork-server preload that makes every later fork in the server fail with EAGAIN.

RLIMIT_NPROC is not enforced for root, and the test suite may run as root: so the server
drops to the ``nobody`` user (its real uid is what the kernel counts processes against)
after setting its process limit to 0. Everything the server needs is imported first.
"""

from __future__ import annotations

import os
import resource

import aioelastic._core.child._bootstrap  # noqa: F401 - imported before the uid change

NOBODY = 65534

resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
if os.getuid() == 0:
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
