"""`vllm-dsa-dbo` (and `python -m vllm_dsa_dbo`): the commands, once the plugin's own
dependency is known to import, so that an install made with --no-deps gets a line, not a
traceback."""

from __future__ import annotations

import sys
from importlib.util import find_spec


def main() -> int:
    if find_spec("packaging") is None:
        problem = (
            "the Python package packaging, which vllm-dsa-dbo requires, is not installed "
            "(was the plugin installed with --no-deps?): pip install packaging"
        )
        if sys.argv[1:2] == ["status"]:
            print(f"fix NOT active: {problem}")
            return 1
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from vllm_dsa_dbo.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(main())
