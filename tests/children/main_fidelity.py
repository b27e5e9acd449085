"""Prints what a script sees of its own start, to compare ``python script.py`` with ours."""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "name": __name__,
                "argv": sys.argv,
                "path0": sys.path[0],
                "file": __file__,
                "spec": repr(globals().get("__spec__")),
                "main_is_this": sys.modules["__main__"].__dict__ is globals(),
            }
        )
    )
