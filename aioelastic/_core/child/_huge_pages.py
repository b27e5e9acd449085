"""The fork server's memory in huge pages, so forks and exits of its workers cost less.

A fork copies one page-table entry for each 4 KiB page of the parent's private memory,
and the child's exit takes them down again. A server that imported torch holds about
140 MB of such memory: 8-15 ms of kernel time for each worker's fork and exit, paid
inside the server's loop (where forks happen one after the other) and in every
teardown. In 2 MiB pages the same memory needs one entry for each 2 MiB, and a fork and
exit take about a third of the time. Workers see no difference in their own memory:
when a worker writes to a huge page it shares with the server, the kernel splits that
page in the worker's mapping only and copies 4 KiB, as before.

:func:`fold_into_huge_pages` folds the server's memory with ``madvise(MADV_COLLAPSE)``
(Linux 6.1) after the preload and before the first fork: tens to a few hundred
milliseconds, once per server. Only before the first fork: the kernel folds no page a
live child still shares. Only regions that are almost fully resident: a reserved arena
or a thread's stack would otherwise be filled in, growing the server's memory.

Where the kernel cannot (Linux older than 6.1, transparent huge pages set to ``never``),
nothing changes. ``AIOELASTIC_FORKSERVER_HUGEPAGES=0`` turns the folding off.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from collections.abc import Iterator

__all__ = ["HUGE_PAGES_ENV", "fold_into_huge_pages"]

#: Set to ``0`` to keep the fork server's memory in 4 KiB pages.
HUGE_PAGES_ENV = "AIOELASTIC_FORKSERVER_HUGEPAGES"

_MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
#: The share of a region that must be resident for it to be folded.
_DENSE = 0.9
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def _dense_private_regions(smaps: str) -> Iterator[tuple[int, int]]:
    """The huge-page-aligned spans of dense private anonymous memory in ``smaps``."""
    region: tuple[int, int] | None = None
    for line in smaps.splitlines():
        mapping = _MAPPING.match(line)
        if mapping is not None:
            low, high, perms, path = mapping.groups()
            private_anonymous = perms == "rw-p" and (not path or path == "[heap]")
            region = (int(low, 16), int(high, 16)) if private_anonymous else None
        elif region is not None and line.startswith("Rss:"):
            low, high = region
            region = None
            resident = int(line.split()[1]) * 1024
            start = -(-low // HUGE_PAGE) * HUGE_PAGE
            end = high // HUGE_PAGE * HUGE_PAGE
            if end > start and resident >= _DENSE * (high - low):
                yield start, end


def fold_into_huge_pages() -> None:
    """Fold this process's dense private memory into huge pages (before it forks).

    Best effort: a page the kernel cannot fold now (no free huge page) stays as it is;
    a refusal that holds for every page (no ``MADV_COLLAPSE``) ends the folding.
    """
    if os.environ.get(HUGE_PAGES_ENV) == "0":
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        with open("/proc/self/smaps") as f:
            smaps = f.read()
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    # EAGAIN, ENOMEM: some page of a span could not be folded now (the rest of it was).
    # EINVAL (no MADV_COLLAPSE, huge pages off) holds for every span.
    passing = (errno.EAGAIN, errno.ENOMEM, errno.EBUSY)
    for start, end in _dense_private_regions(smaps):
        failed = madvise(start, end - start, _MADV_COLLAPSE) != 0
        if failed and ctypes.get_errno() not in passing:
            return
