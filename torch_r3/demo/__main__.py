"""`python -m torch_r3.demo`: the demo's command line."""

import sys

from torch_r3.demo.cli import main

sys.exit(main())
