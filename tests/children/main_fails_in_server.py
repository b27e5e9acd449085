"""A script that cannot be imported as anything but ``__main__``.

Run as ``python tests/children/main_fails_in_server.py``: it starts a function of its own
through the fork server (which must import this script, as ``__mp_main__``, and fails),
then a module's function (which needs no import of the script and works). Prints a JSON
report of both outcomes.
"""

from __future__ import annotations

import json

import anyio

from aioelastic._core.start._forkserver import ForkServerError
from tests.children import core

if __name__ != "__main__":
    raise RuntimeError("this script refuses to be imported")


def double(value: int) -> int:
    return 2 * value


async def _run() -> dict[str, object]:
    report: dict[str, object] = {}
    try:
        await core.one_on_server("script", double, 21)
        report["script_call"] = "started"
    except ForkServerError as exc:
        report["script_call"] = str(exc)
    module = await core.one_on_server("module", core.add, 1, 2)
    report["module_call"] = module.return_values
    return report


print(json.dumps(anyio.run(_run)))
