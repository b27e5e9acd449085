"""A fork-server preload whose import blocks (like a 15 s ``import torch``).

It writes ``importing pid=<pid>`` to the FIFO named by ``AIOELASTIC_TEST_READY``, then
blocks reading a pipe nobody writes to, until it is killed.
"""

from __future__ import annotations

import os

with open(os.environ["AIOELASTIC_TEST_READY"], "w") as ready:
    ready.write(f"importing pid={os.getpid()}\n")

_never_r, _never_w = os.pipe()
os.read(_never_r, 1)
