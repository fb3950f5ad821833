"""`python -m cx_plugins.plan` is `cx-plan`."""

import sys

from cx_plugins.plan._cli import main

sys.exit(main())
