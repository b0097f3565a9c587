"""`python -m rawinfer ...` is the `rawinfer` command."""

import sys

from .cli import main

sys.exit(main())
