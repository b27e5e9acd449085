"""Running ``python -m aioelastic.run`` as a user does, as a subprocess read line by line.

A test waits for a worker's ``ready`` line on the launcher's stdout before it signals
anyone, and waits on pidfds to check that processes are gone.

These tests are synchronous (the launcher is a plain subprocess), so the waits here block
with a timeout; :mod:`tests.support.waits` has the event-loop counterparts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.support.paths import REPO


class Launcher:
    """A running ``python -m aioelastic.run``, its output collected line by line."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        new_session: bool = False,
        command: Sequence[str] = (sys.executable, "-m", "aioelastic.run"),
    ) -> None:
        """Start ``command`` with ``argv``; ``command`` may wrap the launcher (``srun ...``)."""
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            [*command, *argv],
            cwd=REPO,
            env=env,
            # A session of its own: a node of several, whose signals reach no other node.
            start_new_session=new_session,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._changed = threading.Condition()
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: object, lines: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                lines.append(line)
                self._changed.notify_all()
        stream.close()  # type: ignore[attr-defined]
        with self._changed:
            self._changed.notify_all()

    @property
    def stdout(self) -> str:
        """Everything the launcher wrote to stdout so far."""
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        """Everything the launcher wrote to stderr so far."""
        return "".join(self.err)

    def wait_for(
        self, pattern: re.Pattern[str], count: int, timeout: float = 60
    ) -> list[re.Match[str]]:
        """The first ``count`` stdout lines matching ``pattern`` (waits for them)."""

        def found() -> list[re.Match[str]]:
            return [m for line in self.out if (m := pattern.search(line))]

        with self._changed:
            self._changed.wait_for(
                lambda: len(found()) >= count or self.proc.poll() is not None, timeout
            )
        matches = found()
        assert len(matches) >= count, (
            f"wanted {count} x {pattern.pattern!r}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )
        return matches[:count]

    def wait_for_stderr(self, text: str, timeout: float = 60) -> None:
        """Wait until ``text`` appears on stderr (fails the test after ``timeout``)."""
        with self._changed:
            ok = self._changed.wait_for(lambda: text in self.stderr, timeout)
        assert ok, f"{text!r} not on stderr:\n{self.stderr}"

    def finish(self, timeout: float = 90) -> int:
        """Wait for the launcher to exit and its output to be read; its exit status.

        ``timeout`` bounds the whole (the exit and the reading), so that a test's waits
        add up to its own timeout; past it, ``subprocess.TimeoutExpired``.
        """
        deadline = time.monotonic() + timeout
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return code

    def kill(self) -> None:
        """SIGKILL the launcher if it still runs, then :meth:`finish`."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()


@contextmanager
def launcher(*argv: str, env: dict[str, str] | None = None) -> Iterator[Launcher]:
    """A launcher running ``argv``, killed and waited for on the way out."""
    run = Launcher(argv, env)
    try:
        yield run
    finally:
        run.kill()


def launch(*argv: str, env: dict[str, str] | None = None, timeout: float = 90) -> Launcher:
    """Run the launcher to completion."""
    with launcher(*argv, env=env) as run:
        run.finish(timeout)
    return run


def env_lines(run: Launcher) -> list[dict[str, str]]:
    """The environments the workers of ``run`` printed (``tests/children/cli.py env``)."""
    return [json.loads(line[4:]) for line in run.out if line.startswith("ENV ")]


def with_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``extra`` added (for a launcher's ``env``)."""
    return {**os.environ, **extra}
