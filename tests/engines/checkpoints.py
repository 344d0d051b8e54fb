"""Tiny seeded MoE checkpoints for a real engine, and the independent reference for their routes.

Importable from any test or benchmark that drives a real vLLM (`tests.engines.checkpoints`):

- `Tiny`: a checkpoint's recipe (family, sizes, seed, router scale). `Tiny.write(path)` builds
  the `transformers` model from a seeded config, scales every router's weights by
  `router_scale` (so that routing is decisive: the k-th and (k+1)-th logits lie far apart in
  fp32 and in the engine's arithmetic alike), and saves it with `save_pretrained` (safetensors,
  float32). With `chat=True` a tiny word-level tokenizer and a chat template written here are
  saved beside it (the chat endpoint needs them; token-id requests do not).
- `QWEN3`, `OLMOE`, `QWEN3_WIDE` (320 experts: past 256, so vLLM sends `uint16`): the recipes
  the engine tests use.
- `load(path)`: the saved model, in fp32, eval mode.
- `router_logits(model, token_ids)`: every layer's router logits `[T, layers, experts]` from one
  fp32 forward with plain forward hooks on the router modules (nothing of `torch_r3`);
  `top_k(logits, k)` their top-k, sorted ascending (compare routes as sets), and the smallest gap
  between the k-th and (k+1)-th logit; `reference_routes(model, token_ids)` both in one call.
- `sorted_rows(routes)`: any `[rows, layers, topk]` array with each row's experts sorted, for
  set comparison.

Nothing here imports vLLM: the recipes and the reference run in any environment with `transformers`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "OLMOE",
    "QWEN3",
    "QWEN3_WIDE",
    "Tiny",
    "WORDS",
    "load",
    "reference_routes",
    "router_logits",
    "sorted_rows",
    "top_k",
]

# The word-level tokenizer's vocabulary: specials first (ids 0..4), then these words.
SPECIALS = ("<unk>", "<pad>", "<eos>", "<|im_start|>", "<|im_end|>")
WORDS = tuple(
    "the a an of to and in is it that for on with as was at by be this are or from not but have had his her "
    "they we you he she one all were there their been when who will more if no out so said what up its about "
    "than into them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three user assistant system hello model "
    "route expert token layer".split()
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@dataclass(frozen=True)
class Tiny:
    """A tiny MoE checkpoint's recipe: a seeded `transformers` config and a router scale.

    Attributes:
        family: `"qwen3_moe"`, `"olmoe"` or `"mixtral"`.
        num_experts: Routed experts per layer.
        topk: Experts per token.
        layers: Decoder layers (every one MoE).
        seed: `torch.manual_seed` before the model is built.
        router_scale: Every router weight is multiplied by it after init.
        vocab_size: Token ids are `[0, vocab_size)`.
        extra: More config fields.
    """

    family: str
    num_experts: int = 16
    topk: int = 4
    layers: int = 4
    seed: int = 0
    router_scale: float = 20.0
    vocab_size: int = 512
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self) -> Any:
        """The `transformers` config of this recipe."""
        import transformers

        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=64,
            num_hidden_layers=self.layers,
            num_attention_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel for 16
            num_key_value_heads=1,
            max_position_embeddings=1024,
            num_experts_per_tok=self.topk,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=SPECIALS.index("<eos>"),
            pad_token_id=SPECIALS.index("<pad>"),
            torch_dtype="float32",
        )
        if self.family == "qwen3_moe":
            return transformers.Qwen3MoeConfig(
                **common,
                head_dim=32,
                intermediate_size=64,
                moe_intermediate_size=32,
                num_experts=self.num_experts,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                **self.extra,
            )
        if self.family == "olmoe":
            return transformers.OlmoeConfig(
                **common, intermediate_size=32, num_experts=self.num_experts, norm_topk_prob=False, **self.extra
            )
        if self.family == "mixtral":
            return transformers.MixtralConfig(
                **common, head_dim=32, intermediate_size=32, num_local_experts=self.num_experts, **self.extra
            )
        raise ValueError(f"unknown family {self.family!r}")

    def write(self, path: Path, *, chat: bool = False) -> Path:
        """Build the model from the seeded config, scale its routers, save it (and, with `chat`, a tokenizer)."""
        import transformers

        path = Path(path)
        torch.manual_seed(self.seed)
        model = transformers.AutoModelForCausalLM.from_config(self.config(), dtype=torch.float32)
        with torch.no_grad():
            for router in _routers(model):
                router.weight.mul_(self.router_scale)
        model.save_pretrained(path)
        if chat:
            write_tokenizer(path, self.vocab_size)
        return path


# The chat checkpoint's vocabulary is the tokenizer's: every id the engine samples decodes to a word.
QWEN3 = Tiny("qwen3_moe", vocab_size=len(SPECIALS) + len(WORDS))
OLMOE = Tiny("olmoe", num_experts=8, topk=2, layers=3, seed=1)
QWEN3_WIDE = Tiny("qwen3_moe", num_experts=320, topk=4, layers=2, seed=2, router_scale=60.0)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `SPECIALS + WORDS` (ids below `vocab_size`) with `CHAT_TEMPLATE`."""
    import tokenizers
    import transformers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    if len(vocab) != len(SPECIALS) + len(WORDS):
        raise ValueError("the tokenizer's words must be distinct")
    if len(vocab) > vocab_size:
        raise ValueError(f"{len(vocab)} words do not fit a {vocab_size}-token vocabulary")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<eos>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    # vLLM reads the generation config's eos; keep it the tokenizer's.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": SPECIALS.index("<eos>")}))


def load(path: Path) -> torch.nn.Module:
    """The saved checkpoint as a `transformers` model in fp32, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32)
    return model.eval()


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router module of every decoder layer, in layer order (`mlp.gate` in all three families)."""
    routers = [layer.mlp.gate for layer in model.model.layers]
    for r in routers:
        if not isinstance(getattr(r, "weight", None), torch.nn.Parameter):
            raise TypeError(f"{type(r).__name__}: expected a router with a weight")
    return routers


def router_logits(model: torch.nn.Module, token_ids: Any) -> np.ndarray:
    """Every layer's router logits for `token_ids`, from one fp32 forward: `[T, layers, num_experts]`."""
    routers = _routers(model)
    logits: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            logits[i] = (output[0] if isinstance(output, tuple) else output).detach().float()

        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    try:
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).unsqueeze(0)
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([logits[i].reshape(ids.shape[1], -1) for i in range(len(routers))], dim=1).numpy()


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """The top-`k` experts of `[..., E]` logits, sorted ascending, and the smallest k-th/(k+1)-th logit gap."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    values = np.take_along_axis(logits, order[..., : k + 1], axis=-1)
    gap = float((values[..., k - 1] - values[..., k]).min()) if values.size else float("inf")
    return np.sort(order[..., :k], axis=-1).astype(np.int64), gap


def reference_routes(model: torch.nn.Module, token_ids: Any) -> tuple[np.ndarray, float]:
    """Each layer's router top-k for every token of `token_ids`, from one fp32 forward of `model`.

    Returns:
        `[T, layers, topk]` int64 with each row sorted ascending, and the smallest gap between
        the k-th and (k+1)-th router logit over all (token, layer) pairs (how decisive routing was).
    """
    return top_k(router_logits(model, token_ids), int(model.config.num_experts_per_tok))


def sorted_rows(routes: Any) -> np.ndarray:
    """`routes` `[rows, layers, topk]` as int64 with each row's experts sorted ascending."""
    return np.sort(np.asarray(routes).astype(np.int64), axis=-1)
