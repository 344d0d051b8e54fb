"""torch_r3 beside the peers' collations: `torch-r3 bench` with `benchmarks/peers.py` registered.

python -m benchmarks.compare                       # the default shape, every strategy, speed-up over the baseline
python -m benchmarks.compare --check-targets       # the project's speed targets (benchmarks/targets.py)
python -m benchmarks.compare --num-sequences 8 --max-seqlen 256 --no-progress   # a quick small run
python -m benchmarks.compare --help                # every option of torch-r3 bench

Run from the checkout's root. It is `torch-r3 bench` itself, with two
defaults changed: `--strategies` is every strategy, peers included, the
baseline first (`benchmarks.peers.COMPARE_ORDER`), and `--speedup-over
baseline`; options given here override them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks.peers import BASELINE, COMPARE_ORDER
from torch_r3 import cli

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run `torch-r3 bench` with the peers; `argv` as its options (default: this command's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return cli.main(["bench", "--strategies", ",".join(COMPARE_ORDER), "--speedup-over", BASELINE, *args])


if __name__ == "__main__":
    sys.exit(main())
