"""`python -m rawinfer.convert SRC DST [--dtype float32|bfloat16|float16] [--force]`."""

import sys

from rawinfer.convert import main

sys.exit(main())
