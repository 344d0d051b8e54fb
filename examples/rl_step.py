"""One RL step with R3 end to end; the code lives in ``torch_r3/demo.py``.

Same as ``torch-r3 demo`` and ``python -m torch_r3.demo``.
"""

import sys

from torch_r3.demo import main

if __name__ == "__main__":
    sys.exit(main())
