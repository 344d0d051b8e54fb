"""The collation kernel's private helpers, beside the kernel they serve (`torch_r3.collate`).

* `route_inputs`: the per-sample checks of the routes, token counts and `out=`;
* `samples`: `R3Collator`'s side of a batch (the samples' keys, per-token fields, extra keys);
* `filler`: the routes written where none was captured;
* `writers`: the two writers, each output byte once;
* `pool`: the copy threads;
* `memory`: where an output lives (pinned, shared, plain) and the private mappings;
* `buffers`: the recycled outputs (`BufferPool`, public as `torch_r3.BufferPool`).

Nothing here is imported by this `__init__`: each module is reached by its path.
"""
