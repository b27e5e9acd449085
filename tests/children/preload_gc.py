"""A module to preload that notes the cyclic collector's state while it is imported.

:func:`collector_state`, run in a worker forked from the server, reports that state and
the worker's own.
"""

from __future__ import annotations

import gc

THRESHOLD_AT_IMPORT = gc.get_threshold()


def collector_state() -> dict[str, object]:
    """The collector as the preload import saw it, and as this worker has it."""
    return {
        "threshold_at_import": list(THRESHOLD_AT_IMPORT),
        "threshold": list(gc.get_threshold()),
        "enabled": gc.isenabled(),
        "frozen": gc.get_freeze_count(),
    }
