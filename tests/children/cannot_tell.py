"""``aioelastic-run`` whose keyboard router cannot tell from ``/proc`` who reads its stdin.

Run as ``python tests/children/cannot_tell.py ARGS``, as ``aioelastic-run ARGS``. The
machine's system call numbers are unknown to it (``_tty_readers._CALLS`` emptied), so
``reads_terminal`` answers ``None``, as it does on an unknown machine or without ptrace
access, and the router falls back on prompts: a worker whose output ends with one counts
as reading.
"""

from __future__ import annotations

import runpy
import sys

from aioelastic._core.output import _tty_readers

_tty_readers._CALLS = {}
sys.argv[0] = "aioelastic-run"
runpy.run_module("aioelastic.run", run_name="__main__", alter_sys=False)
