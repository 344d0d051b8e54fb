"""The receiving side: routes (and DSA indexer selections) from the inference engine into host memory.

Stage 1 of the data path (engine -> **rollout** -> health -> collate -> replay -> trainer).

* `client`: `RemoteGenerateClient`, the HTTP client for SGLang, vLLM and torch_r3's own server;
* `transport`: the connection pool, retries, timeouts and size caps (`TransportConfig`);
* `protocols`: one module per server's generate API, each reading answers into one `ParsedResponse`;
* `codec`: the route wire codec (`encode_routes` / `decode_routes`, SGLang's and vLLM's encodings);
* `trace`: `RoutedExpertTrace`, a trajectory's routes across the turns of a multi-turn rollout;
* `inprocess`: routes from in-process engines (vLLM's `LLM` / `AsyncLLM` outputs);
* `results`: `RemoteGenerateResult`, one generate call's answer;
* `selections_wire`, `selections_trace`: the same for the DSA indexer's selections;
* `_base64`, `_npy`, `_offload`, `_row_store`: the stage's private kernels.

Nothing is imported by this `__init__` (the client needs aiohttp): each module is reached by its path.
"""

__all__: list[str] = []
