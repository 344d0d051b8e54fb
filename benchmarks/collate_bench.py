#!/usr/bin/env python
"""The collation benchmark: the same engine as `torch-r3 bench` (the package `torch_r3.bench`).

python benchmarks/collate_bench.py                      # the default run
python benchmarks/collate_bench.py --json out.json --plot out.png
python benchmarks/collate_bench.py --help               # every option
"""

import sys

from torch_r3.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
