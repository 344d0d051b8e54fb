"""The independent reference's flat keywords in torch_r3's spelling: one `layout=` value and one `memory=` value.

`tests/reference_collate.py` imports nothing from torch_r3 and keeps the flat
keywords (`layout="padded", padding_side="right", seq_len=8, workers=2`); a
test that hands the same options to the reference and to torch_r3 passes them
through `torch_r3_options` for the latter.
"""

from __future__ import annotations

from typing import Any

from torch_r3 import Memory, Packed, Padded, PromptResponse

_LAYOUT = {
    "padding_side": "side",
    "pad_to_multiple_of": "pad_to_multiple_of",
    "seq_len": "seq_len",
    "prompt_width": "prompt_width",
    "response_width": "response_width",
    "prompt_length_key": "prompt_length_key",
}
_MEMORY = ("workers", "pin_memory", "cache_bytes", "buffers", "max_output_bytes")
_CLASSES = {"padded": Padded, "packed": Packed, "prompt_response": PromptResponse}


def torch_r3_options(**options: Any) -> dict[str, Any]:
    """`options` with the layout's and the memory's keywords folded into `layout=` and `memory=` values.

    A `None` option is the default, as in the flat spelling; a layout that is
    already a value passes through (with no flat layout keyword beside it).
    """
    out = dict(options)
    name = out.pop("layout", "padded")
    fields = {new: out.pop(old) for old, new in _LAYOUT.items() if old in out}
    fields = {k: v for k, v in fields.items() if v is not None}
    if isinstance(name, str) and name in _CLASSES:
        out["layout"] = _CLASSES[name](**fields)
    elif isinstance(name, str):  # no layout: the collator's to refuse
        out["layout"] = name
    else:
        assert not fields, f"flat layout keywords {sorted(fields)} next to the value {name!r}"
        out["layout"] = name
    memory = {k: out.pop(k) for k in _MEMORY if k in out}
    if memory:
        out["memory"] = Memory(**memory)
    return out
