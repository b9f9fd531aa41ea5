"""`python -m eaglespec` is the `eaglespec` command."""

import sys

from .cli import main

sys.exit(main())
