"""`python -m rawinfer ...` is the `rawinfer` command."""

import sys

from rawinfer.frontends.cli.main import main

sys.exit(main())
