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
from mlx.utils import tree_flatten, tree_map

from gmlx.config import is_input_major_enabled
from gmlx.platform.cpu_layout import store_weights_input_major

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
        x = fused + self.down_proj(nn.silu(self.gate_proj(normed)) * self.up_proj(normed))
        return self.final_norm(x)


def save_mtp_head(head: MTPHead, args: MTPHeadArgs, path: Union[str, Path]) -> None:
    """Write config.json and model.safetensors (float16, to keep the repository small)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / CONFIG_FILE, "w") as f:
        json.dump(asdict(args), f, indent=2)
        f.write("\n")
    weights = dict(tree_flatten(head.parameters()))
    weights = {name: value.astype(mx.float16) for name, value in weights.items()}
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


def load_mtp_head(path: Union[str, Path]) -> MTPHead:
    """Load a head saved by save_mtp_head; parameters are float32 in memory.

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
    try:
        # strict: a missing, extra or mis-shaped tensor is a broken head, not a partial one.
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"MTP head at {path}: weights do not match config: {e}") from e
    head.update(tree_map(lambda p: p.astype(mx.float32), head.parameters()))
    mx.eval(head.parameters())
    if mx.default_device() == mx.cpu and is_input_major_enabled():
        store_weights_input_major(head)  # its products are one-row decode products too
    head.eval()
    return head
