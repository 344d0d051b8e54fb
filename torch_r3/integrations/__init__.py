"""Drop-ins for the RL trainers people run: `torch_r3.integrations.skyrl`, `torch_r3.integrations.verl`.

Each subpackage replaces one trainer's own route plumbing with `torch_r3`'s,
returning the trainer's own types, so that the rest of the trainer runs
unchanged. They import the trainer lazily (on first call), so that importing
them needs only `torch_r3`; the versions each is tested against are in its
docstring. `import torch_r3` never imports them.
"""

__all__: list[str] = []  # the subpackages are the surface: torch_r3.integrations.skyrl, .verl
