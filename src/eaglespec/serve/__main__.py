"""`python -m eaglespec.serve ...` is `eaglespec serve ...`."""

import sys

from .cli import main

sys.exit(main())
