"""A fork-server preload that leaves the server no room for a worker's pipes.

It lowers the server's open-file limit (RLIMIT_NOFILE, `ulimit -n`) to what it holds now
plus one (for the selector the server opens after the preload), so the kernel cannot
install the fds passed with a start request.
"""

from __future__ import annotations

import os
import resource

_open_now = len(os.listdir("/proc/self/fd")) - 1  # minus the fd listdir itself used
_, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (_open_now + 1, _hard))
