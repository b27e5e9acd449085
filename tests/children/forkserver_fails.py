"""A fork-server preload that fails to import, counting its imports.

Each import appends a line to the file named by ``AIOELASTIC_TEST_IMPORTS``.
"""

from __future__ import annotations

import os

with open(os.environ["AIOELASTIC_TEST_IMPORTS"], "a") as imports:
    imports.write(f"{os.getpid()}\n")

raise ImportError("this preload fails to import on purpose")
