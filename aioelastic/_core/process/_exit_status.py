"""How a process exited, in words: the one place a signal number becomes a name."""

from __future__ import annotations

import signal

__all__ = ["exit_description", "signal_name", "signal_text"]


def signal_name(signum: int) -> str | None:
    """The name of signal ``signum`` (``"SIGKILL"``); ``None`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return None


def signal_text(signum: int) -> str:
    """The name of signal ``signum``, or ``"signal <n>"`` for a number with no name."""
    return signal_name(signum) or f"signal {signum}"


def exit_description(exitcode: int) -> str:
    """``"exited with code 3"``, ``"killed by SIGKILL (signal 9)"`` (negative: a signal)."""
    if exitcode < 0:
        name = signal_name(-exitcode)
        if name is None:
            return f"killed by signal {-exitcode}"
        return f"killed by {name} (signal {-exitcode})"
    return f"exited with code {exitcode}"
