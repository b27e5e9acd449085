"""A preload with the memory shapes the fork server folds into huge pages, or must not.

``DENSE``: 32 MiB of private anonymous memory, every page written (as a preload's heap
is). ``SPARSE``: a 64 MiB one with one page written (a reserved arena, a stack): folding
it would fill in 63 MiB the server never used. Each is a mapping of its own in
``/proc/PID/smaps``: the kernel merges neighbouring mappings alike in every flag, so each
gets a flag no other mapping has (not dumped; not inherited by a fork).
"""

from __future__ import annotations

import mmap

DENSE_BYTES = 32 << 20
SPARSE_BYTES = 64 << 20

_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # mmap's default is shared memory

DENSE = mmap.mmap(-1, DENSE_BYTES, flags=_PRIVATE)
DENSE.madvise(mmap.MADV_DONTDUMP)
DENSE.write(b"\x01" * DENSE_BYTES)
SPARSE = mmap.mmap(-1, SPARSE_BYTES, flags=_PRIVATE)
SPARSE.madvise(mmap.MADV_DONTFORK)
SPARSE[0] = 1
