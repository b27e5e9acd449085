"""A script whose fork-server workers run a module's function, then one of its own.

Its module level appends a line to ``MARKS`` each time it is executed: as the script
(``__main__``) and, if the fork server imports it, as ``__mp_main__``. Usage:
``python tests/children/lazy_main.py MARKS`` prints a JSON report.
"""

from __future__ import annotations

import json
import os
import sys

import anyio

from tests.children import core

with open(sys.argv[1], "a") as _marks:
    _marks.write(f"{__name__}\n")


def double(value: int) -> int:
    return 2 * value


async def _run() -> dict[str, object]:
    marks = sys.argv[1]

    def imported() -> list[str]:
        with open(marks) as f:
            return f.read().split()

    first = await core.one_on_server("module", core.add, 1, 2)
    after_module_call = imported()
    second = await core.one_on_server("script", double, 21)
    return {
        "module_call": first.return_values,
        "after_module_call": after_module_call,
        "script_call": second.return_values,
        "after_script_call": imported(),
        "pid": os.getpid(),
    }


if __name__ == "__main__":
    print(json.dumps(anyio.run(_run)))
