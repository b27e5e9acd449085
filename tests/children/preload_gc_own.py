"""A module to preload that sets collector thresholds of its own when imported.

Never imported by a test process itself (it would change that process's collector).
"""

from __future__ import annotations

import gc

from tests.children.preload_gc import collector_state

gc.set_threshold(5000, 20, 20)

__all__ = ["collector_state"]
