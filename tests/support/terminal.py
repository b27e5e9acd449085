"""``aioelastic-run`` under a real pseudo-terminal, as a person runs it (tests/core/output).

The launcher's stdin, stdout and stderr are the slave side of a pty (its controlling
terminal, the launcher the foreground job); a test reads exactly what the terminal
receives from the master side and types into it. The outer pty keeps its defaults (so a
``\\n`` arrives as ``\\r\\n``, and what is typed is echoed), as a real terminal's. The
``terminal`` fixture (tests/core/output/conftest.py) closes every one a test started.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import threading

from tests.support.paths import CHILDREN, REPO

#: The workers of the terminal tests: tests/children/terminal.py.
SCRIPT = str(CHILDREN / "terminal.py")


def _set_size(fd: int, columns: int, lines: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))


def take_terminal() -> None:
    # In the child, after setsid and the dup2s: fd 0 becomes the controlling terminal
    # and this process group its foreground job, as a shell arranges for a command.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


#: How the launcher is run: ``aioelastic-run``.
LAUNCHER = [sys.executable, "-m", "aioelastic.run"]


class Terminal:
    """``aioelastic-run ARGV`` (or ``launcher ARGV``) on a pty of ``columns`` x ``lines``."""

    def __init__(
        self,
        argv: list[str],
        *,
        columns: int = 101,
        lines: int = 37,
        launcher: list[str] = LAUNCHER,
    ) -> None:
        self.master, slave = os.openpty()
        _set_size(slave, columns, lines)
        env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "LOGLEVEL")}
        try:
            self.proc = subprocess.Popen(
                [*launcher, *argv],
                cwd=REPO,
                env=env,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                start_new_session=True,
                preexec_fn=take_terminal,
            )
        finally:
            os.close(slave)
        self.data = bytearray()
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError as exc:
                if exc.errno != errno.EIO:  # EIO: every slave side is closed
                    raise
                chunk = b""
            with self._cond:
                if not chunk:
                    self._cond.notify_all()
                    return
                self.data += chunk
                self._cond.notify_all()

    def wait_for(self, pattern: bytes, timeout: float = 60) -> re.Match[bytes]:
        """The first match of the regex ``pattern`` in what the terminal received."""
        compiled = re.compile(pattern)
        with self._cond:
            found = self._cond.wait_for(lambda: compiled.search(self.data), timeout)
            assert found, f"{pattern!r} not on the terminal after {timeout} s: {self.text()!r}"
            return found

    def text(self) -> bytes:
        return bytes(self.data[-3000:])

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def resize(self, columns: int, lines: int) -> None:
        # As a terminal emulator does: the kernel sends SIGWINCH to the foreground job.
        _set_size(self.master, columns, lines)

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._reader.join(30)
        os.close(self.master)
