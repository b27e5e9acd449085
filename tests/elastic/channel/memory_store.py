"""An in-memory stand-in for torch's c10d ``Store``, for the job channel's unit tests.

Only the calls the channel makes (``set``, ``get``, ``add``, ``check``, ``wait``), each
behaving as torch's stores do (checked against ``torch.distributed.HashStore``, torch 2.13):

* values are bytes; ``set`` takes ``str`` (stored UTF-8) or bytes;
* ``add(key, n)`` is atomic: it creates a missing counter at ``n`` and returns the new value;
  the counter reads back through ``get`` as its decimal digits; ``add`` on a value that is
  not a number raises ``ValueError``;
* ``get`` of a missing key waits until another thread sets it, up to the store's timeout,
  then raises a ``RuntimeError`` (torch's ``DistStoreError``: ``"Wait timeout"``);
* ``wait(keys, timeout)`` waits until every key exists, else raises the same error;
* ``check(keys)`` says whether every key exists, without waiting.

Several channels share one instance across their threads, as the nodes of a round share
the rendezvous store.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterable

__all__ = ["MemoryStore", "StoreTimeout"]


class StoreTimeout(RuntimeError):
    """What torch raises as ``DistStoreError`` (a ``RuntimeError``) when a wait times out."""


class MemoryStore:
    """A store in this process's memory, safe to share between threads.

    Args:
        timeout: seconds ``get`` waits for a missing key (torch's store timeout).
    """

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._values[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        self._wait_for([key], self.timeout)
        with self._changed:
            return self._values[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            current = int(self._values.get(key, b"0"))
            self._values[key] = str(current + amount).encode()
            self._changed.notify_all()
            return current + amount

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(key in self._values for key in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self._wait_for(keys, timeout.total_seconds())

    def _wait_for(self, keys: Iterable[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(key in self._values for key in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeout("Wait timeout")
                self._changed.wait(left)
