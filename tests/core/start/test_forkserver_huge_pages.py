"""The fork server's memory in huge pages: its dense memory folded, its sparse memory left.

Where the kernel folds with ``MADV_COLLAPSE`` (Linux >= 6.1) the server folds the dense
anonymous mappings its preload made, and workers forked from it compute as before; the
environment can keep it in small pages; what is planned for folding is read from smaps.
"""

from __future__ import annotations

import re

import anyio
import pytest

from aioelastic._core.start._forkserver import fork_server
from tests.support.fork_server import add_on_server, stop_fork_server as _stop


def _collapse_works_here() -> bool:
    """Whether this kernel folds a dense anonymous mapping with MADV_COLLAPSE (Linux 6.1)."""
    import ctypes
    import mmap

    from aioelastic._core.child._huge_pages import HUGE_PAGE

    region = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.write(b"\x01" * len(region))
        anchor = ctypes.c_char.from_buffer(region)
        start = -(-ctypes.addressof(anchor) // HUGE_PAGE) * HUGE_PAGE
        del anchor
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return bool(libc.madvise(start, HUGE_PAGE, 25) == 0)
    finally:
        region.close()


def _mappings(pid: int) -> list[dict[str, int]]:
    """Size, Rss and AnonHugePages (bytes) of each mapping of ``pid``."""
    found: list[dict[str, int]] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
                low, high = (int(x, 16) for x in head[0].split("-"))
                found.append({"size": high - low})
            elif head[0] in ("Rss:", "AnonHugePages:"):
                found[-1][head[0][:-1]] = int(head[1]) * 1024
    return found


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_server_folds_its_dense_memory_into_huge_pages_and_leaves_sparse_memory() -> None:
    if not _collapse_works_here():
        pytest.skip("this kernel does not fold memory with MADV_COLLAPSE (Linux >= 6.1)")
    from tests.children import preload_dense

    preload = ("tests.children.preload_dense",)
    try:
        assert (await add_on_server("before", preload, (1, 2), (3, 4))).return_values == {
            0: 3,
            1: 7,
        }
        server = fork_server(preload)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 2  # forked from the folded memory
        assert server.pid is not None
        mappings = _mappings(server.pid)
        dense = [m for m in mappings if m["size"] == preload_dense.DENSE_BYTES]
        sparse = [m for m in mappings if m["size"] == preload_dense.SPARSE_BYTES]
        assert len(dense) == 1
        assert len(sparse) == 1
        # Every whole huge page of the dense mapping (its ends may not be aligned).
        assert dense[0]["AnonHugePages"] >= preload_dense.DENSE_BYTES - (4 << 20)
        assert sparse[0]["AnonHugePages"] == 0
        assert sparse[0]["Rss"] <= 1 << 20
        # Workers forked from the folded server, and from its spares, compute as before.
        for name in ("from spares", "forked"):
            result = await add_on_server(name, preload, (5, 6), (7, 8))
            assert result.return_values == {0: 11, 1: 15}
    finally:
        _stop(preload)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_hugepages_env_zero_keeps_the_server_in_small_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[always]" in f.read():
            pytest.skip("huge pages are always on here: the kernel folds without being asked")
    from aioelastic._core.child._huge_pages import HUGE_PAGES_ENV
    from tests.children import preload_dense

    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    preload = ("tests.children.preload_dense", "json")  # a server of this test's own
    try:
        assert (await add_on_server("small", preload, (1, 2))).return_values == {0: 3}
        server = fork_server(preload)
        with anyio.fail_after(30):
            assert await server.spares_ready() == 1
        assert server.pid is not None
        dense = [m for m in _mappings(server.pid) if m["size"] == preload_dense.DENSE_BYTES]
        assert dense[0]["AnonHugePages"] == 0
        assert dense[0]["Rss"] == preload_dense.DENSE_BYTES
    finally:
        _stop(preload)


def test_only_dense_private_anonymous_memory_is_planned_for_folding() -> None:
    from aioelastic._core.child._huge_pages import HUGE_PAGE, _dense_private_regions

    mib = 1 << 20
    smaps = "\n".join(
        [
            # The heap, dense, its ends not aligned: the whole huge pages inside it.
            f"{3 * HUGE_PAGE - mib:x}-{7 * HUGE_PAGE + mib:x} rw-p 00000000 00:00 0   [heap]",
            f"Size: {(4 * HUGE_PAGE + 2 * mib) // 1024} kB",
            f"Rss: {(4 * HUGE_PAGE + 2 * mib) // 1024} kB",
            # Dense anonymous memory: planned.
            f"{10 * HUGE_PAGE:x}-{12 * HUGE_PAGE:x} rw-p 00000000 00:00 0",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            # Sparse: left alone.
            f"{20 * HUGE_PAGE:x}-{30 * HUGE_PAGE:x} rw-p 00000000 00:00 0",
            "Rss: 4 kB",
            # A file's data, the stack, read-only and shared memory: never.
            f"{40 * HUGE_PAGE:x}-{42 * HUGE_PAGE:x} rw-p 00000000 08:01 42   /usr/lib/libx.so",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            f"{50 * HUGE_PAGE:x}-{52 * HUGE_PAGE:x} rw-p 00000000 00:00 0   [stack]",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            f"{60 * HUGE_PAGE:x}-{62 * HUGE_PAGE:x} r--p 00000000 00:00 0",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            f"{70 * HUGE_PAGE:x}-{72 * HUGE_PAGE:x} rw-s 00000000 00:01 7   /dev/zero",
            f"Rss: {2 * HUGE_PAGE // 1024} kB",
            # Dense but smaller than one aligned huge page: nothing to fold.
            f"{80 * HUGE_PAGE + mib:x}-{81 * HUGE_PAGE + mib:x} rw-p 00000000 00:00 0",
            f"Rss: {HUGE_PAGE // 1024} kB",
        ]
    )
    assert list(_dense_private_regions(smaps)) == [
        (3 * HUGE_PAGE, 7 * HUGE_PAGE),
        (10 * HUGE_PAGE, 12 * HUGE_PAGE),
    ]
