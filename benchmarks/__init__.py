"""The project's benchmarks, in a checkout only (the installed package has none of them).

`python -m benchmarks.compare` times torch_r3 beside the peers' collations
(`benchmarks/peers.py`); `benchmarks/targets.py` holds the speed targets
`torch-r3 bench --check-targets` judges. The other files are scripts, run by
path (see `benchmarks/README.md`).
"""
