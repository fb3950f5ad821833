"""How a tools/gpu_check step script reports to tools/gpu_check.sh: its last `RESULT:`, `SKIP:` or `FAIL:` line is the
report's detail, and its exit status the step's status (0 pass, 77 skip, anything else fail).

A library that is not installed (other than torch and cx's own packages, which the check needs) makes the step a skip
naming it: a lent GPU machine has torch but may lack the optional libraries, and no package index to fetch them from.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

SKIP_STATUS = 77  # automake's "skipped" exit status


class Skip(Exception):
    """The step cannot run here (no CUDA, a compute capability too old, a missing library); the message says why."""


def run_step(main: Callable[[], str]) -> None:
    """Run `main`, print its one-line result and exit with the step's status."""
    try:
        result = main()
    except Skip as skip:
        print(f"SKIP: {skip}", flush=True)
        sys.exit(SKIP_STATUS)
    except Exception as error:
        missing = (error.name or "").split(".")[0] if isinstance(error, ModuleNotFoundError) else ""
        if missing and missing != "torch" and not missing.startswith("cx_"):
            print(f"SKIP: needs {missing}, which is not installed here", flush=True)
            sys.exit(SKIP_STATUS)
        traceback.print_exc()  # for the log; then one line for the report
        print(f"FAIL: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", flush=True)
        sys.exit(1)
    print(f"RESULT: {result}", flush=True)
