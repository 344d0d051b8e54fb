"""What SGLang's two base64 payloads share: the routes (`meta_info.routed_experts`, decoded by
`codec.decode_sglang_routes`) and the indexer's selections (`meta_info.indexer_topk`, decoded by
`selections_wire.decode_sglang_indexer_topk`).

Both arrive as flat little-endian rows with no header, inside `meta_info` or a whole `/generate`
answer, so both decoders unwrap the answer the same way and count the rows the same way, from the
decoded byte count, before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch_r3.errors import WireFormatError

__all__ = ["meta_info", "whole_rows"]


def meta_info(value: Any, name: str) -> Any:
    """`value["meta_info"]` when `value` is a whole answer (it must be a mapping), else `value` itself."""
    if (type(value) is dict or isinstance(value, Mapping)) and "meta_info" in value:  # a dict: no ABC check
        value = value["meta_info"]
        if type(value) is not dict and not isinstance(value, Mapping):
            raise WireFormatError(f"{name}: expected meta_info to be a mapping, got {type(value).__name__}")
    return value


def whole_rows(
    nbytes: int, row_bytes: int, dims: Mapping[str, int], num_tokens: int | None, name: str, dtype: str
) -> int:
    """The rows of `row_bytes` bytes (`dims` elements of `dtype`) that `nbytes` decoded bytes hold.

    Raises:
        WireFormatError: `nbytes` is not a whole number of rows, or `num_tokens` is given and the
            row count is another.
    """
    if nbytes % row_bytes:
        named = ", ".join(f"{key}={size}" for key, size in dims.items())
        raise WireFormatError(
            f"{name}: {nbytes} decoded bytes is not a whole number of {dtype} rows of [{named}] ({row_bytes} bytes each)"
        )
    rows = nbytes // row_bytes
    if num_tokens is not None and rows != num_tokens:
        sizes = ", ".join(str(size) for size in dims.values())
        raise WireFormatError(f"{name}: expected {num_tokens} rows of [{sizes}], got {rows}")
    return rows
