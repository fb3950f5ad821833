"""`python -m cx_train` is `cx-train` (also the module torchrun runs on each rank)."""

import sys

from cx_train._cli import main

sys.exit(main())
