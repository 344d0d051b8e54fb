"""`python -m torch_r3`: the `torch-r3` command line."""

import sys

from torch_r3.cli import main

sys.exit(main())
