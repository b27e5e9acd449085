"""Fixtures for tests that run torch's TCPStores in the test process (a pytest plugin).

``tests/conftest.py`` loads this plugin; a module asks for its fixtures with
``pytestmark = pytest.mark.usefixtures("torch_store_warmed", "collect_stores")``. Nothing
here imports torch until a fixture runs, so the suite still loads where torch is absent.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def torch_store_warmed() -> None:
    """torch opens a process-wide pipe with the first TCPStore and keeps it for good.

    Create it before any test's file-descriptor snapshot, so the leak check sees only what
    a test itself leaves open.
    """
    import torch.distributed as torch_distributed

    store = torch_distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    del store


@pytest.fixture
def collect_stores() -> Iterator[None]:
    """Free the TCPStores (and their sockets) a test dropped before the leak check runs."""
    yield
    gc.collect()


@pytest.fixture
def agent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean environment for an agent run in the test process.

    ``OMP_NUM_THREADS`` and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` set by the developer's shell
    would change what the agent gives its workers, which the tests check.
    """
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
