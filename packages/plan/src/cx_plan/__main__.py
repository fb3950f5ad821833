"""`python -m cx_plan` is `cx-plan`."""

import sys

from cx_plan._cli import main

sys.exit(main())
