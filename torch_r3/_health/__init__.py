"""Private helpers of the engine-health checks (`torch_r3.health`).

* `scan`: the checks' passes over each row's expert ids read as packed machine words.
* `row_memory`: the bounded memory of recent route-row blocks (replayed rows across requests).
* `hints`: the findings' hint texts, shared with the replay core's zero-route check.
"""
