"""The argument checks of `RemoteGenerateClient`: each value is checked once, here, before anything is sent.

Bad input gets a `TypeError` or `ValueError` naming the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import yarl

from torch_r3._checks import check_indices, check_int, check_str
from torch_r3._deprecation import RENAMED_KEYWORDS
from torch_r3.rollout.protocols.fields import check_cache_salt
from torch_r3.rollout.transport import TransportConfig

# Token ids travel as int64 (torch.long).
TOKEN_ID_END = 1 << 63
#: The keywords `RemoteGenerateClient` took one by one before 0.3.0 (`RENAMED_KEYWORDS`' entries for them).
FLAT_TRANSPORT_KEYWORDS = tuple(k for k, v in RENAMED_KEYWORDS.items() if v.new == "transport_config")


def fold_transport_config(config: Any, flat: dict[str, Any]) -> TransportConfig:
    """The client's `TransportConfig`: `config` when given, else one built from the deprecated flat keywords.

    Raises:
        TypeError: `config` is not a `TransportConfig`, or a flat value is of the wrong kind.
        ValueError: `config` together with a flat keyword away from its default, or a flat value out of range.
    """
    if config is None:
        return TransportConfig(**flat)
    if not isinstance(config, TransportConfig):
        raise TypeError(f"transport_config must be a TransportConfig, got {type(config).__name__}")
    defaults = TransportConfig()
    changed = [name for name, value in flat.items() if value != getattr(defaults, name)]
    if changed:
        raise ValueError(
            f"give either transport_config= or the keywords {sorted(changed)}, not both "
            f"(they are options of TransportConfig: TransportConfig({changed[0]}=...))"
        )
    return config


def check_base_url(base_url: Any) -> str:
    check_str(base_url, "base_url")
    try:
        url = yarl.URL(base_url)
        port = url.port
    except (ValueError, TypeError) as exc:
        raise ValueError(f"base_url {base_url!r} is not a valid URL (bad port?): {exc}") from None
    if url.scheme not in ("http", "https"):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    if not url.host:
        raise ValueError(f"base_url has no host: {base_url!r}")
    if url.user is not None or url.password is not None:
        raise ValueError("base_url must not hold credentials (user:password@); send them with headers= instead")
    if url.query_string:
        raise ValueError(
            f"base_url must not have a query string ({url.query_string!r}): the endpoint path is appended to it"
        )
    if url.fragment:
        raise ValueError(f"base_url must not have a fragment ({url.fragment!r})")
    if port is None:  # pragma: no cover - yarl fills the scheme's default
        raise ValueError(f"base_url has no port: {base_url!r}")
    if url.path.rstrip("/").endswith("/v1"):
        # An OpenAI-style base URL: the endpoint paths below already hold their
        # version, so /v1 + /inference/v1/generate would be a path no server has.
        raise ValueError(
            f"base_url {base_url!r} ends in /v1, an OpenAI-style base URL; give the server root "
            f"without /v1 (e.g. {str(url.with_path(url.path.rstrip('/')[:-3] or '/')).rstrip('/')!r}): "
            "the client appends the endpoint's full path"
        )
    return base_url.rstrip("/")


def check_moe_layers(moe_layers: Any, num_layers: int | None) -> tuple[int, ...]:
    if moe_layers is None:
        return ()
    return check_indices(moe_layers, "moe_layers", limit=num_layers, what="layer")


def check_salt(salt: Any) -> str | None:
    return None if salt is None else check_cache_salt(salt)


def check_start(start: Any, prompt_len: int, want_routes: bool) -> int:
    if start is None:
        return 0
    start = check_int(start, "routed_experts_prompt_start")
    if not 0 <= start <= prompt_len:
        raise ValueError(f"routed_experts_prompt_start must be in [0, len(prompt)={prompt_len}], got {start}")
    if not want_routes:
        raise ValueError("routed_experts_prompt_start requires return_routed_experts=True")
    return start


def check_prompt(tokens: Any) -> list[int]:
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch.Tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"prompt_token_ids: expected a 1-D integer array, got {tokens.ndim}-D {tokens.dtype}")
        out = tokens.tolist()
    elif isinstance(tokens, (list, tuple)):
        out = [check_int(t, f"prompt_token_ids[{i}]") for i, t in enumerate(tokens)]
    else:
        raise TypeError(f"prompt_token_ids: expected a list of ints, got {type(tokens).__name__}")
    for i, t in enumerate(out):
        if not 0 <= t < TOKEN_ID_END:
            raise ValueError(f"prompt_token_ids[{i}] = {t}: token ids must be in [0, 2**63)")
    return out


def check_sampling_params(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise TypeError(f"sampling_params: expected a mapping, got {type(params).__name__}")
    n = params.get("n", 1)
    if n is not None and n != 1:
        # SGLang answers n > 1 with a JSON list and vLLM with one choice per
        # sample: a result holds one sample, so the others would be lost.
        raise ValueError(
            f"sampling_params['n'] = {n!r}: the client asks for one sample per call; "
            "call generate once per sample (with distinct seeds)"
        )
    return dict(params)
