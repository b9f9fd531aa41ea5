"""`python -m eaglespec.train` / `torchrun --nproc-per-node N -m eaglespec.train ...`."""

import sys

from .cli import main

sys.exit(main())
