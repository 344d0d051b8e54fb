"""SGLang's `meta_info.indexer_topk`, decoded into `IndexerSelections`, bounded before allocating.

SGLang (0.5.23+, server flag `--enable-return-indexer-topk`, request field
`"return_indexer_topk": true`, DP attention only) returns the indexer's
selections of a `/generate` call in `meta_info["indexer_topk"]`: base64 of the
raw little-endian `int32` bytes of `[seqlen - 1, num_indexer_layers,
index_topk]`, flat, with no header. Row `j` is the query at position `j`; a
query that sees `j + 1 <= index_topk` positions holds `0 .. j` and then `-1`.
For DeepSeek-V3.2-style models `num_indexer_layers` is every hidden layer: a
layer that reuses an earlier layer's top-k (`index_topk_freq > 1`) gets a
mirrored copy, which the compact form stores once.

At 2048 `int32` per token per layer the dense payload is about 8 KiB per token
per layer, so the decoder never holds it whole: the byte count is computed
from the length of the base64 text and checked against the cap and the row
size first, then the text is decoded in bounded steps, each step's whole rows
checked and encoded (`SelectionEncoder`) before the next step is decoded.
"""

from __future__ import annotations

import base64
import binascii
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from torch_r3._checks import check_non_negative, check_positive
from torch_r3.rollout._sglang_payload import meta_info, whole_rows
from torch_r3.rollout.codec import WireFormatError, base64_decoded_length
from torch_r3.selections import IndexerSelections, SelectionEncoder

__all__ = ["DEFAULT_MAX_INDEXER_BYTES", "FIELD", "decode_sglang_indexer_topk"]

FIELD = "indexer_topk"
"""The `meta_info` key SGLang answers with (and the request flag is `return_indexer_topk`)."""

DEFAULT_MAX_INDEXER_BYTES = 1 << 32
"""Default cap on the dense bytes of one payload (4 GiB: 8k tokens of a 61-layer, top-2048 model)."""

# Base64 characters decoded per step (a multiple of 4): 32 MiB of text -> 24 MiB of rows.
_STEP_CHARS = 32 << 20
_STRICT = sys.version_info >= (3, 11)  # binascii strict_mode


def _b64(chunk: Any) -> bytes:
    if _STRICT:
        # strict_mode is Python 3.11+; mypy checks against 3.10's signature
        return binascii.a2b_base64(chunk, strict_mode=True)  # type: ignore[call-arg]
    return base64.b64decode(chunk, validate=True)  # pragma: no cover - Python 3.10


def decode_sglang_indexer_topk(
    value: Any,
    *,
    num_layers: int,
    index_topk: int,
    num_tokens: int | None = None,
    max_bytes: int = DEFAULT_MAX_INDEXER_BYTES,
    name: str = "meta_info.indexer_topk",
) -> IndexerSelections:
    """Decode SGLang's `indexer_topk` into compact `IndexerSelections`, checking every row.

    Args:
        value: The base64 text (`str` or bytes), or a mapping holding it:
            SGLang's `meta_info`, or a whole `/generate` answer with `meta_info`.
        num_layers: Indexer layers per row (SGLang's `num_indexer_layers`: the
            model's `num_hidden_layers` for DeepSeek-V3.2-style models).
        index_topk: Positions each query selects (the model's `index_topk`).
        num_tokens: When given, the exact row count expected (`seqlen - 1`).
        max_bytes: Largest dense payload accepted, in bytes.
        name: What to call the value in error messages.

    Returns:
        The selections, `rows = decoded bytes / (num_layers * index_topk * 4)`.

    Raises:
        TypeError: a count is not an `int`.
        ValueError: a count is not positive.
        WireFormatError: the field is missing or not base64 text, the payload
            is over `max_bytes` or not a whole number of rows (or not
            `num_tokens` rows), or a row is not a valid selection (a position
            negative, after its query or repeated; a short row not `0 .. j`).

    Examples:
        >>> import base64, numpy as np
        >>> rows = np.array([[[0, -1]], [[0, 1]], [[2, 0]]], dtype="<i4")
        >>> meta = {"indexer_topk": base64.b64encode(rows.tobytes()).decode()}
        >>> decode_sglang_indexer_topk(meta, num_layers=1, index_topk=2).to_dense()[:, 0].tolist()
        [[0, -1], [0, 1], [0, 2]]
    """
    L = check_positive(num_layers, f"{name}: num_layers")
    K = check_positive(index_topk, f"{name}: index_topk")
    cap = check_non_negative(max_bytes, f"{name}: max_bytes")
    if num_tokens is not None:
        check_non_negative(num_tokens, f"{name}: num_tokens")
    text = _field(value, name)
    row_bytes = L * K * 4
    nbytes = base64_decoded_length(text, name=name)
    if nbytes > cap:
        raise WireFormatError(f"{name}: int32 selections of {nbytes} bytes, over the cap max_bytes={cap}")
    rows = whole_rows(nbytes, row_bytes, {"num_layers": L, "index_topk": K}, num_tokens, name, "int32")
    encoder = SelectionEncoder(rows=rows, num_layers=L, index_topk=K, name=name)
    pending = b""
    done = 0
    try:
        for start in range(0, len(text), _STEP_CHARS):
            raw = pending + _b64(text[start : start + _STEP_CHARS])
            whole = len(raw) // row_bytes
            if done + whole > rows:
                raise WireFormatError(f"{name}: invalid base64 (more bytes than its length promises)")
            if whole:
                step = np.frombuffer(raw, dtype="<i4", count=whole * L * K).reshape(whole, L, K)
                encoder.add(step if step.dtype.isnative else step.astype(np.int32))
                done += whole
            pending = raw[whole * row_bytes :]
    except binascii.Error as exc:
        raise WireFormatError(f"{name}: invalid base64 ({exc})") from None
    except WireFormatError:
        raise
    except ValueError as exc:  # a row that is not a selection
        raise WireFormatError(str(exc)) from None
    if pending or done != rows:  # padding inside the text, e.g. "AA==AAAA"
        raise WireFormatError(f"{name}: invalid base64 (decoded {done} rows, its length promises {rows})")
    return encoder.finish()


def _field(value: Any, name: str) -> Any:
    data = meta_info(value, name)
    if isinstance(data, Mapping):
        if data.get(FIELD) is None:
            raise WireFormatError(
                f"{name}: no {FIELD!r} in meta_info (was the server started with --enable-return-indexer-topk "
                "and the request sent with return_indexer_topk=True?)"
            )
        data = data[FIELD]
    if isinstance(data, (list, tuple)):
        raise WireFormatError(f"{name}: list-form selections are not accepted; expected SGLang's base64 string")
    return data
