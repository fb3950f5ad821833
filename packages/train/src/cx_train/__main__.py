"""`python -m cx_plugins.demo` is `cx-train` (also the module torchrun runs on each rank)."""

import sys

from cx_plugins.demo._cli import main

sys.exit(main())
