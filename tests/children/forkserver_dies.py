"""A fork-server preload that makes the server die on its first start request.

The death is real (the server process exits, the supervisor sees end-of-file on its
socket); only its moment is chosen. With ``AIOELASTIC_TEST_DIE_ONCE`` naming a file, only
the first server to find that file missing dies (it creates it), so its replacement works;
without it, every server dies.
"""

from __future__ import annotations

import os

_once = os.environ.get("AIOELASTIC_TEST_DIE_ONCE")
_dies = True
if _once:
    try:
        os.close(os.open(_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        _dies = False

if _dies:

    def _die_instead_of_forking() -> int:
        os._exit(3)

    os.fork = _die_instead_of_forking
