"""A one-layer multi-token-prediction (MTP) head that drafts from the target's hidden state.

The head sees only (h_t, x_{t+1}) at each position: the target's final hidden state at
position t and the token that follows it. It has no attention over history, because the
runtime cold-starts it from a single captured hidden state per row and so has no history
to offer it. Its output lives in the same space as the target's final hidden state, so
the target's own lm_head turns it into logits for x_{t+2}, and it can be fed back in as
`hidden` to chain further drafts.

    fused  = Linear(2D -> D)(concat(norm(h_t), norm(embed(x_{t+1}))))
    x      = fused + SwiGLU(norm(fused))
    output = final_norm(x)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from gmlx.models.draft_vocab import DRAFT_VOCAB_KEY, check_draft_vocab
from gmlx.platform.cpu_drafter_products import prepare_drafter_products
from gmlx.platform.cpu_quantized import project

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "gmlx_mtp_head"


@dataclass
class MTPHeadArgs:
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    model_type: str = MODEL_TYPE
    # A head distilled from one exact model file says which (the built-in head: None, any
    # target of its shape); the drafter refuses it for any other file.
    target_sha256: str | None = None
    target_name: str | None = None
    # How many tokens the head drafts from (gmlx/models/draft_vocab.py); None: all of them.
    draft_vocab_size: int | None = None


class MTPHead(nn.Module):
    def __init__(self, args: MTPHeadArgs):
        super().__init__()
        self.args = args
        dim = args.hidden_size
        eps = args.rms_norm_eps
        # Hidden state and token embedding arrive at different scales; normalise each
        # before mixing so neither drowns the other.
        self.hidden_norm = nn.RMSNorm(dim, eps=eps)
        self.embed_norm = nn.RMSNorm(dim, eps=eps)
        self.fuse_proj = nn.Linear(2 * dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=eps)
        self.gate_proj = nn.Linear(dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, dim, bias=False)
        # The target's hidden state is the output of its final RMSNorm; ending on a norm
        # puts the head's output on the same scale, so the target's lm_head applies.
        self.final_norm = nn.RMSNorm(dim, eps=eps)
        # silu(gate) * up; on the CPU beside a quantized target, the kernels' one-node SwiGLU.
        self.swiglu = swiglu

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, embed_tokens: nn.Embedding
    ) -> mx.array:
        """hidden (B, T, D), next_tokens (B, T) -> head hidden (B, T, D).

        lm_head(result) gives logits for the token after `next_tokens`.
        """
        token_embeddings = embed_tokens(next_tokens).astype(hidden.dtype)
        fused = self.fuse_proj(
            mx.concatenate(
                [self.hidden_norm(hidden), self.embed_norm(token_embeddings)], axis=-1
            )
        )
        normed = self.mlp_norm(fused)
        gate, up = project(normed, (self.gate_proj, self.up_proj))  # one node in the kernels' quad layout
        x = fused + self.down_proj(self.swiglu(gate, up))
        return self.final_norm(x)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def save_mtp_head(head: MTPHead, args: MTPHeadArgs, path: Union[str, Path],
                  draft_token_ids: mx.array | None = None) -> None:
    """Write config.json and model.safetensors (float16, to keep the repository small), with the
    head's draft vocabulary (int32 token ids) when it has one."""
    path = Path(path)
    if draft_token_ids is not None:
        check_draft_vocab(draft_token_ids, args.vocab_size, f"MTP head at {path}")
    path.mkdir(parents=True, exist_ok=True)
    args.draft_vocab_size = None if draft_token_ids is None else int(draft_token_ids.size)
    with open(path / CONFIG_FILE, "w") as f:
        json.dump(asdict(args), f, indent=2)
        f.write("\n")
    weights = dict(tree_flatten(head.parameters()))
    weights = {name: value.astype(mx.float16) for name, value in weights.items()}
    if draft_token_ids is not None:
        weights[DRAFT_VOCAB_KEY] = draft_token_ids
    mx.save_safetensors(str(path / WEIGHTS_FILE), weights, metadata={"format": "mlx"})


def _read_args(path: Path) -> MTPHeadArgs:
    config_path = path / CONFIG_FILE
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"MTP head at {path}: cannot read {CONFIG_FILE}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"MTP head at {path}: {CONFIG_FILE} is not a JSON object")
    if config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(
            f"MTP head at {path}: model_type is {config.get('model_type')!r}, "
            f"expected {MODEL_TYPE!r}"
        )
    known = {field.name for field in fields(MTPHeadArgs)}
    try:
        return MTPHeadArgs(**{k: v for k, v in config.items() if k in known})
    except TypeError as e:
        raise ValueError(f"MTP head at {path}: bad {CONFIG_FILE}: {e}") from e


def load_mtp_head(path: Union[str, Path], target_format: tuple[int, int] | None = None) -> MTPHead:
    """Load a head saved by save_mtp_head; parameters are float32 in memory, and on the CPU
    quantized to target_format (bits, group_size) in the kernels when its target is quantized
    (cpu_drafter_products). Its draft vocabulary, if any: `head.draft_token_ids`.

    Raises ValueError naming `path` when the folder, config or weights are missing or
    do not match each other.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"MTP head at {path}: no such directory")
    args = _read_args(path)
    head = MTPHead(args)
    weights_path = path / WEIGHTS_FILE
    try:
        weights = mx.load(str(weights_path))
    except Exception as e:  # mlx raises bare RuntimeError/ValueError for I/O and format
        raise ValueError(f"MTP head at {path}: cannot read {WEIGHTS_FILE}: {e}") from e
    draft_token_ids = weights.pop(DRAFT_VOCAB_KEY, None)
    if (draft_token_ids is None) != (args.draft_vocab_size is None) or (
            draft_token_ids is not None and draft_token_ids.size != args.draft_vocab_size):
        raise ValueError(f"MTP head at {path}: {CONFIG_FILE} says draft_vocab_size {args.draft_vocab_size}, "
                         f"{WEIGHTS_FILE} holds {0 if draft_token_ids is None else draft_token_ids.size} draft ids")
    if draft_token_ids is not None:
        check_draft_vocab(draft_token_ids, args.vocab_size, f"MTP head at {path}")
    try:
        # strict: a missing, extra or mis-shaped tensor is a broken head, not a partial one.
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"MTP head at {path}: weights do not match config: {e}") from e
    head.update(tree_map(lambda p: p.astype(mx.float32), head.parameters()))
    mx.eval(head.parameters())
    head.layout = prepare_drafter_products(head, target_format)  # one-row decode products too
    # numpy, not mx: an mx array attribute would join the head's parameters (and its saves).
    head.draft_token_ids = None if draft_token_ids is None else np.array(draft_token_ids)
    head.eval()
    return head
