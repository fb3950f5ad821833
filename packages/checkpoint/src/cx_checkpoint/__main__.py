"""`python -m cx_checkpoint verify <folder>`: the same check as the `cx-checkpoint-verify` command."""

from __future__ import annotations

import sys

from cx_checkpoint._verify import main

if __name__ == "__main__":
    arguments = sys.argv[1:]
    if not arguments or arguments[0] != "verify":
        print("usage: python -m cx_checkpoint verify <folder>", file=sys.stderr)
        sys.exit(1)
    sys.exit(main(arguments[1:]))
