"""A module that starts a thread when imported: unsafe to fork, so ``--preload`` refuses it."""

from __future__ import annotations

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, name="poller", daemon=True).start()
