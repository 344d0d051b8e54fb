"""The receiving side's private helpers, beside the codec, client, trace and health check they serve.

* `base64`, `npy`: the wire codec's kernels (strict chunked base64, a `.npy` reader that never unpickles);
* `offload`: where large payloads are decoded, off the client's event loop;
* `results`: `RemoteGenerateResult`, one generate call's answer (public as `torch_r3.RemoteGenerateResult`);
* `row_store`: `TokenMetadataTrace`, the trace's per-token rows (public through `torch_r3.trace`);

Nothing here is imported by this `__init__`: each module is reached by its path.
"""
