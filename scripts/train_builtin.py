#!/usr/bin/env python
"""Train the built-in models that ship with gmlx, from the Python standard library sources.

Produces, under --out-dir (default gmlx/models/builtin):
  target/   qwen3 target model in mlx-lm folder format, with a byte-level BPE tokenizer
  draft/    a much cheaper qwen3 draft model sharing that tokenizer
  mtp/      a one-layer MTP head distilled from the frozen target's hidden states
  metrics.json

Every bar is measured on whole held-out files and printed. Run from the repository root:
    python scripts/train_builtin.py
The defaults reproduce the shipped weights (seeded; CPU float summation order can still
make the last digits differ between machines).
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# gmlx must be imported before mlx: it loads the system OpenBLAS globally, which makes
# float32 matmuls on this CPU ~20x faster than the BLAS bundled in the mlx wheel.
from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models import qwen3  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from gmlx.models.mtp_head import MTPHead, MTPHeadArgs, load_mtp_head, save_mtp_head  # noqa: E402
from mtp_training import (Tally, chained_mtp_loss, lr_schedule, make_adamw,  # noqa: E402
                          make_mtp_optimizer, run_steps)
from text_corpus import is_heldout, list_code_files  # noqa: E402

EOS_TOKEN = "<|endoftext|>"
MAX_POSITION_EMBEDDINGS = 1024
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6

# Stage ids keep each stage's randomness independent of which other stages ran.
STAGE_SEED_OFFSETS = {"target": 1, "draft": 2, "mtp": 3, "eval": 4}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "gmlx/models/builtin")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/gmlx_train_builtin"),
                   help="scratch space: the jointly pre-trained head before distillation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", default="target,draft,mtp",
                   help="stages to train; the others are loaded from --out-dir")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--heldout-per-mille", type=int, default=30,
                   help="share of whole files held out for validation, in 1/1000")
    p.add_argument("--seq-len", type=int, default=128)
    # Target
    p.add_argument("--target-hidden", type=int, default=256)
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--target-intermediate", type=int, default=768)
    p.add_argument("--target-heads", type=int, default=4)
    p.add_argument("--target-kv-heads", type=int, default=2)
    p.add_argument("--target-steps", type=int, default=1500)
    p.add_argument("--target-batch", type=int, default=8)
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="muon",
                   help="muon: Muon for block matrices, AdamW for embeddings and norms")
    p.add_argument("--muon-lr", type=float, default=0.02)
    # Draft
    p.add_argument("--draft-hidden", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-intermediate", type=int, default=512)
    p.add_argument("--draft-heads", type=int, default=2)
    p.add_argument("--draft-kv-heads", type=int, default=1)
    p.add_argument("--draft-steps", type=int, default=1200)
    p.add_argument("--draft-batch", type=int, default=8)
    p.add_argument("--draft-lr", type=float, default=4e-3)
    # MTP head
    p.add_argument("--mtp-intermediate", type=int, default=768,
                   help="MLP width of a fresh head; with --mtp-init, a larger value widens "
                        "the loaded head (its function unchanged) before fine-tuning")
    p.add_argument("--mtp-joint-weight", type=float, default=0.2,
                   help="weight of the MTP loss while pre-training the target with the "
                        "head (0: plain target, head trained from scratch afterwards)")
    p.add_argument("--mtp-init", type=Path, default=None,
                   help="start the MTP head from this saved head (a fine-tune) instead of the "
                        "joint-trained or a fresh one")
    p.add_argument("--mtp-steps", type=int, default=200)
    p.add_argument("--mtp-batch", type=int, default=8)
    p.add_argument("--mtp-lr", type=float, default=2e-3)
    p.add_argument("--mtp-optimizer", choices=["adamw", "muon"], default="muon")
    p.add_argument("--mtp-chain-weight", type=float, default=0.5,
                   help="loss weight of the second, chained draft during training")
    p.add_argument("--mtp-greedy-weight", type=float, default=0.0,
                   help="weight of a cross-entropy on the target's greedy token, beside the "
                        "soft distillation loss")
    p.add_argument("--mtp-hidden-weight", type=float, default=1.0,
                   help="weight of the squared error to the target's next hidden state")
    # Shared optimisation and evaluation
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--eval-tokens", type=int, default=1 << 17,
                   help="held-out tokens scored for the final bars")
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--rollout-prompts", type=int, default=64,
                   help="held-out prompts continued greedily to measure acceptance")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


# ---------------------------------------------------------------- corpus and tokenizer

def read_corpus(stdlib_dir: Path, heldout_per_mille: int):
    train_texts, heldout_texts = [], []
    skipped_files = 0
    for path in list_code_files(stdlib_dir):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            # A few test fixtures are deliberately latin-1 or broken; not worth learning.
            skipped_files += 1
            continue
        rel = path.relative_to(stdlib_dir).as_posix()
        (heldout_texts if is_heldout(rel, heldout_per_mille) else train_texts).append(text)
    return train_texts, heldout_texts, skipped_files


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # All 256 byte symbols up front, so any input text is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: every document followed by EOS."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pieces = []
    for encoding in tokenizer.encode_batch(texts):
        pieces.append(np.asarray(encoding.ids, dtype=np.int32))
        pieces.append(np.array([eos_id], dtype=np.int32))
    return np.concatenate(pieces)


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
    }
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)


# ---------------------------------------------------------------- models and saving

def make_qwen3_config(vocab_size, hidden, layers, intermediate, heads, kv_heads, eos_id):
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": RMS_NORM_EPS,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": True,
        "eos_token_id": eos_id,
        "torch_dtype": "float16",
    }


def build_qwen3(config: dict) -> qwen3.Model:
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def count_params(module: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def round_trip_float16(module: nn.Module) -> None:
    """Make the in-memory float32 weights exactly what float16 on disk will give back,
    so every bar is measured on the weights as shipped."""
    module.update(tree_map(lambda p: p.astype(mx.float16).astype(mx.float32),
                           module.parameters()))
    mx.eval(module.parameters())


def save_lm(model: nn.Module, config: dict, out_dir: Path, tokenizer_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights,
                        metadata={"format": "mlx"})
    write_json(out_dir / "config.json", config)
    if tokenizer_dir != out_dir:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_dir / name, out_dir / name)


def load_lm(model_dir: Path) -> tuple[qwen3.Model, dict]:
    with open(model_dir / "config.json") as f:
        config = json.load(f)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.load_weights(str(model_dir / "model.safetensors"), strict=True)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model, config


def write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------- training

def is_hidden_matrix(path: str, weight: mx.array) -> bool:
    # Muon orthogonalises whole-matrix updates; that suits the square-ish projections
    # inside the blocks and the MTP head, not the (tied) embedding table or the norms.
    return weight.ndim == 2 and (".layers." in path or path.startswith("head."))


def make_lm_optimizer(peak_lr, total_steps, args):
    if args.optimizer == "adamw":
        return make_adamw(peak_lr, total_steps, args)
    muon = optim.Muon(
        learning_rate=lr_schedule(args.muon_lr, total_steps, args.warmup_steps,
                                  args.min_lr_ratio),
        momentum=0.95, weight_decay=0.0,
    )
    return optim.MultiOptimizer([muon, make_adamw(peak_lr, total_steps, args)],
                                [is_hidden_matrix])


def sample_windows(stream: np.ndarray, batch: int, seq_len: int, rng) -> mx.array:
    """Random (batch, seq_len + 1) windows; the extra token is the last label."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return mx.array(stream[starts[:, None] + np.arange(seq_len + 1)])


def lm_loss(model, inputs, labels):
    return nn.losses.cross_entropy(model(inputs), labels, reduction="mean")


def train_lm(name, model, stream, steps, batch, seq_len, peak_lr, rng, args) -> float:
    """Plain next-token training; returns wall seconds spent."""
    optimizer = make_lm_optimizer(peak_lr, steps, args)
    loss_and_grad = nn.value_and_grad(model, lm_loss)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(window):
        loss, grads = loss_and_grad(model, window[:, :-1], window[:, 1:])
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(model, grads)
        return loss

    return run_steps(name, step, state, lambda: (sample_windows(stream, batch, seq_len, rng),),
                     steps, batch * seq_len, args.log_every)


class TargetWithMTP(nn.Module):
    """Target and MTP head as one trainable tree, for joint pre-training."""

    def __init__(self, target: qwen3.Model, head: MTPHead):
        super().__init__()
        self.target = target
        self.head = head


def joint_loss(pair: TargetWithMTP, window, mtp_weight):
    """Next-token loss plus the head's loss on the text's x_{t+2} (DeepSeek-V3 style
    multi-token prediction), so the target's final hidden state learns to carry what
    the head needs about the token after next."""
    tokens, labels = window[:, :-1], window[:, 1:]
    embed = pair.target.model.embed_tokens
    hidden = pair.target.model(tokens)
    next_token_loss = nn.losses.cross_entropy(embed.as_linear(hidden), labels,
                                              reduction="mean")
    head_hidden = pair.head(hidden[:, :-1], tokens[:, 1:], embed)
    mtp_loss_value = nn.losses.cross_entropy(embed.as_linear(head_hidden), labels[:, 1:],
                                             reduction="mean")
    return next_token_loss + mtp_weight * mtp_loss_value, (next_token_loss, mtp_loss_value)


def train_target_with_mtp(target, head, stream, rng, args) -> float:
    pair = TargetWithMTP(target, head)
    optimizer = make_lm_optimizer(args.target_lr, args.target_steps, args)
    loss_and_grad = nn.value_and_grad(pair, joint_loss)
    state = [pair.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(window):
        (_, (next_token_loss, head_loss)), grads = loss_and_grad(
            pair, window, args.mtp_joint_weight)
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(pair, grads)
        return mx.stack([next_token_loss, head_loss])

    return run_steps("target+mtp", step, state,
                     lambda: (sample_windows(stream, args.target_batch, args.seq_len, rng),),
                     args.target_steps, args.target_batch * args.seq_len, args.log_every)


def soft_cross_entropy(student_logits, teacher_probs):
    return -(teacher_probs * nn.log_softmax(student_logits, axis=-1)).sum(axis=-1).mean()


def mtp_step_loss(predicted_hidden, target_hidden, teacher_probs, embed, hidden_weight,
                  greedy_weight):
    logits = embed.as_linear(predicted_hidden)
    loss = soft_cross_entropy(logits, teacher_probs)
    if greedy_weight > 0:
        # The bar (and greedy acceptance) is agreement with the teacher's argmax, which
        # the soft target weighs no more than the rest of its probability mass.
        loss = loss + greedy_weight * nn.losses.cross_entropy(
            logits, teacher_probs.argmax(axis=-1), reduction="mean")
    if hidden_weight > 0:
        # The head's output should *be* the target's next hidden state: a dense signal
        # that also keeps chained drafts fed with something the head was trained on.
        loss = loss + hidden_weight * mx.square(predicted_hidden - target_hidden).mean()
    return loss


def mtp_loss(head, hidden, tokens, teacher_probs, embed, chain_weight, hidden_weight,
             greedy_weight):
    """The teacher at t+1 is its distribution for x_{t+2} and its hidden state."""
    def step_loss(predicted, offset):
        return mtp_step_loss(predicted, hidden[:, offset:], teacher_probs[:, offset:], embed,
                             hidden_weight, greedy_weight)

    return chained_mtp_loss(head, hidden, tokens, embed, chain_weight, step_loss)


def widen_mtp_head(head: MTPHead, intermediate_size: int) -> MTPHead:
    """A head with a wider SwiGLU whose output equals `head`'s: the new units' down-proj
    columns start at zero, so fine-tuning adds capacity without first undoing training."""
    old = head.args.intermediate_size
    assert intermediate_size > old, (intermediate_size, old)
    wide_args = MTPHeadArgs(**{**head.args.__dict__, "intermediate_size": intermediate_size})
    wide = MTPHead(wide_args)
    weights = dict(tree_flatten(head.parameters()))
    fresh = dict(tree_flatten(wide.parameters()))
    for name in ("gate_proj.weight", "up_proj.weight"):
        # Fresh rows keep nn.Linear's init so the new units see gradients once down moves.
        weights[name] = mx.concatenate([weights[name], fresh[name][old:]], axis=0)
    down = weights["down_proj.weight"]
    weights["down_proj.weight"] = mx.concatenate(
        [down, mx.zeros((down.shape[0], intermediate_size - old), dtype=down.dtype)], axis=1)
    wide.load_weights(list(weights.items()), strict=True)
    mx.eval(wide.parameters())
    return wide


def train_mtp(head, target, stream, rng, args) -> float:
    embed = target.model.embed_tokens
    steps = args.mtp_steps
    optimizer = make_mtp_optimizer(steps, args)
    loss_and_grad = nn.value_and_grad(head, mtp_loss)
    state = [head.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def head_step(hidden, tokens, teacher_probs):
        loss, grads = loss_and_grad(head, hidden, tokens, teacher_probs, embed,
                                    args.mtp_chain_weight, args.mtp_hidden_weight,
                                    args.mtp_greedy_weight)
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(head, grads)
        return loss

    def step(window):
        tokens = window[:, :-1]
        # The target is frozen: its hidden states and distributions are plain inputs.
        hidden = mx.stop_gradient(target.model(tokens))
        teacher_probs = mx.softmax(embed.as_linear(hidden), axis=-1)
        return head_step(hidden, tokens, teacher_probs)

    return run_steps("mtp", step, state,
                     lambda: (sample_windows(stream, args.mtp_batch, args.seq_len, rng),),
                     steps, args.mtp_batch * args.seq_len, args.log_every)


# ---------------------------------------------------------------- evaluation

def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping (n, seq_len + 1) windows spread evenly over the held-out stream,
    so the score covers every held-out file family, not just the first in path order."""
    available = (len(stream) - 1) // seq_len
    count = max(1, min(available, max_tokens // seq_len))
    starts = np.linspace(0, available - 1, count).astype(np.int64) * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)]


def evaluate(target, draft, head, windows: np.ndarray, batch: int) -> dict:
    """Score all three models on held-out windows in one pass over the target."""
    tally = Tally()
    embed = target.model.embed_tokens
    for i in range(0, len(windows), batch):
        window = mx.array(windows[i:i + batch])
        tokens, labels = window[:, :-1], window[:, 1:]
        hidden = target.model(tokens)
        target_logits = embed.as_linear(hidden)
        # target_greedy[:, t] is the target's own choice for x_{t+1}.
        target_greedy = target_logits.argmax(axis=-1)
        tally.add("target_loss", nn.losses.cross_entropy(
            target_logits, labels, reduction="sum"), labels.size)

        draft_logits = draft(tokens)
        tally.add("draft_loss", nn.losses.cross_entropy(
            draft_logits, labels, reduction="sum"), labels.size)
        tally.add("draft_agree", (draft_logits.argmax(-1) == target_greedy).sum(),
                  labels.size)

        # First draft: (h_t, x_{t+1}) -> the target's choice at t+1, i.e. for x_{t+2}.
        first = head(hidden[:, :-1], tokens[:, 1:], embed)
        first_hit = embed.as_linear(first).argmax(-1) == target_greedy[:, 1:]
        tally.add("mtp_first", first_hit.sum(), first_hit.size)
        # Greedy decoding only ever feeds the head the target's own choice; score the
        # positions where the text agrees with it, which is the runtime condition.
        on_greedy_path = tokens[:, 1:] == target_greedy[:, :-1]
        tally.add("mtp_first_on_greedy_path", (first_hit & on_greedy_path).sum(),
                  on_greedy_path.sum().item())
        # Second draft, chained on the head's own output, fed the text's x_{t+2}.
        second = head(first[:, :-1], tokens[:, 2:], embed)
        second_hit = embed.as_linear(second).argmax(-1) == target_greedy[:, 2:]
        tally.add("mtp_second", second_hit.sum(), second_hit.size)
        # As at runtime: the first draft was accepted, so the token fed back is both the
        # first draft and the target's greedy choice; score only positions where the
        # text also took that token, so the target's label is conditioned on it.
        accepted = first_hit[:, :-1] & (tokens[:, 2:] == target_greedy[:, 1:-1])
        tally.add("mtp_second_given_first",
                  (second_hit & accepted).sum(), accepted.sum().item())
    return {
        "target_heldout_loss_nats": tally.mean("target_loss"),
        "draft_heldout_loss_nats": tally.mean("draft_loss"),
        "draft_agreement": tally.mean("draft_agree"),
        "mtp_first_draft_agreement": tally.mean("mtp_first"),
        "mtp_second_draft_agreement": tally.mean("mtp_second"),
        "mtp_second_draft_agreement_given_first_accepted":
            tally.mean("mtp_second_given_first"),
        "mtp_first_draft_agreement_on_greedy_path": tally.mean("mtp_first_on_greedy_path"),
    }


def greedy_rollouts(target, windows: np.ndarray, prompt_len: int, gen_len: int,
                    batch: int) -> np.ndarray:
    """Continue held-out prompts with the target's own greedy tokens (KV-cached decode),
    reproducing exactly what a drafter sees while the server decodes greedily."""
    from mlx_lm.models.cache import make_prompt_cache

    rows = []
    for i in range(0, len(windows), batch):
        tokens = mx.array(windows[i:i + batch, :prompt_len])
        cache = make_prompt_cache(target)
        logits = target(tokens, cache=cache)[:, -1]
        generated = []
        for _ in range(gen_len):
            next_tokens = logits.argmax(-1)
            generated.append(next_tokens)
            logits = target(next_tokens[:, None], cache=cache)[:, -1]
        rows.append(mx.concatenate([tokens, mx.stack(generated, axis=1)], axis=1))
    return np.array(mx.concatenate(rows))


def rollout_agreement(target, draft, head, sequences: np.ndarray, prompt_len: int,
                      batch: int) -> dict:
    """Acceptance on greedy rollouts: every token after the prompt is the target's own
    greedy choice, so a draft is accepted exactly when it equals the next token."""
    tally = Tally()
    embed = target.model.embed_tokens
    for i in range(0, len(sequences), batch):
        tokens = mx.array(sequences[i:i + batch])
        hidden = target.model(tokens)
        # Score from the last prompt position on: from there the next token is greedy.
        start = prompt_len - 1
        draft_next = draft(tokens).argmax(-1)
        draft_hit = draft_next[:, start:-1] == tokens[:, start + 1:]
        tally.add("draft", draft_hit.sum(), draft_hit.size)
        first = head(hidden[:, start:-2], tokens[:, start + 1:-1], embed)
        first_hit = embed.as_linear(first).argmax(-1) == tokens[:, start + 2:]
        tally.add("first", first_hit.sum(), first_hit.size)
        # Chained: the head's own output and its (accepted) first draft go back in.
        second = head(first[:, :-1], tokens[:, start + 2:-1], embed)
        second_hit = embed.as_linear(second).argmax(-1) == tokens[:, start + 3:]
        tally.add("second_given_first", (second_hit & first_hit[:, :-1]).sum(),
                  first_hit[:, :-1].sum().item())
    return {
        "rollout_draft_acceptance": tally.mean("draft"),
        "rollout_mtp_first_draft_acceptance": tally.mean("first"),
        "rollout_mtp_second_draft_acceptance_given_first": tally.mean("second_given_first"),
    }


def quick_heldout_loss(model, windows: np.ndarray, batch: int) -> float:
    total_nats, total_tokens = 0.0, 0
    for i in range(0, len(windows), batch):
        window = mx.array(windows[i:i + batch])
        loss = nn.losses.cross_entropy(model(window[:, :-1]), window[:, 1:], reduction="sum")
        total_nats += loss.item()
        total_tokens += window[:, 1:].size
    return total_nats / total_tokens


def sample_generations(model_dir: Path, prompts: list[str], max_tokens: int) -> dict:
    """Load through mlx-lm exactly as a user would, to prove the folder is complete."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    return {p: mlx_lm.generate(model, tokenizer, prompt=p, max_tokens=max_tokens)
            for p in prompts}


# ---------------------------------------------------------------- main

def main():
    args = parse_args()
    stages = set(args.stages.split(",")) - {""}
    unknown = stages - {"target", "draft", "mtp"}
    if unknown:
        raise SystemExit(f"unknown stages: {sorted(unknown)}")
    out_dir = args.out_dir
    target_dir, draft_dir, mtp_dir = out_dir / "target", out_dir / "draft", out_dir / "mtp"
    metrics_path = out_dir / "metrics.json"
    previous = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    metrics = {"seed": args.seed, "seq_len": args.seq_len, "argv": sys.argv[1:]}  # how this run was made
    script_start_s = time.perf_counter()

    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    train_texts, heldout_texts, skipped = read_corpus(stdlib_dir, args.heldout_per_mille)
    print(f"corpus {stdlib_dir}: {len(train_texts)} train files, {len(heldout_texts)} "
          f"held-out files, {skipped} skipped (not UTF-8)", flush=True)

    if "target" in stages:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(train_texts, args.vocab_size)
        write_tokenizer_files(tokenizer, target_dir)
        metrics["tokenizer_train_seconds"] = time.perf_counter() - t0
    else:
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    vocab_size = tokenizer.get_vocab_size()

    t0 = time.perf_counter()
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_stream = encode_stream(tokenizer, heldout_texts)
    train_bytes = sum(len(t.encode()) for t in train_texts)
    heldout_bytes = sum(len(t.encode()) for t in heldout_texts)
    print(f"tokenized in {time.perf_counter() - t0:.0f}s: vocab {vocab_size}, train "
          f"{len(train_stream)} tokens ({train_bytes / len(train_stream):.2f} bytes/token), "
          f"held-out {len(heldout_stream)} tokens", flush=True)
    metrics.update({
        "vocab_size": vocab_size,
        "train_files": len(train_texts), "heldout_files": len(heldout_texts),
        "train_bytes": train_bytes, "heldout_bytes": heldout_bytes,
        "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream)),
    })
    windows = eval_windows(heldout_stream, args.seq_len, args.eval_tokens)
    monitor_windows = windows[:: max(1, len(windows) // 32)]

    # ---- target
    target_config = make_qwen3_config(
        vocab_size, args.target_hidden, args.target_layers, args.target_intermediate,
        args.target_heads, args.target_kv_heads, eos_id)
    mtp_args = MTPHeadArgs(hidden_size=args.target_hidden, vocab_size=vocab_size,
                           intermediate_size=args.mtp_intermediate,
                           rms_norm_eps=RMS_NORM_EPS)
    joint_head_dir = args.work_dir / "mtp_joint"
    if "target" in stages:
        mx.random.seed(args.seed + STAGE_SEED_OFFSETS["target"])
        target = build_qwen3(target_config)
        print(f"target: {count_params(target)} params {target_config}", flush=True)
        rng = np.random.default_rng([args.seed, STAGE_SEED_OFFSETS["target"]])
        if args.mtp_joint_weight > 0:
            joint_head = MTPHead(mtp_args)
            mx.eval(joint_head.parameters())
            metrics["target_train_seconds"] = train_target_with_mtp(
                target, joint_head, train_stream, rng, args)
            save_mtp_head(joint_head, mtp_args, joint_head_dir)
        else:
            shutil.rmtree(joint_head_dir, ignore_errors=True)
            metrics["target_train_seconds"] = train_lm(
                "target", target, train_stream, args.target_steps, args.target_batch,
                args.seq_len, args.target_lr, rng, args)
        round_trip_float16(target)
        save_lm(target, target_config, target_dir, target_dir)
        print(f"target quick held-out loss "
              f"{quick_heldout_loss(target, monitor_windows, args.eval_batch):.3f}", flush=True)
    else:
        target, target_config = load_lm(target_dir)
    target.eval()

    # ---- draft
    draft_config = make_qwen3_config(
        vocab_size, args.draft_hidden, args.draft_layers, args.draft_intermediate,
        args.draft_heads, args.draft_kv_heads, eos_id)
    if "draft" in stages:
        mx.random.seed(args.seed + STAGE_SEED_OFFSETS["draft"])
        draft = build_qwen3(draft_config)
        print(f"draft: {count_params(draft)} params {draft_config}", flush=True)
        rng = np.random.default_rng([args.seed, STAGE_SEED_OFFSETS["draft"]])
        metrics["draft_train_seconds"] = train_lm(
            "draft", draft, train_stream, args.draft_steps, args.draft_batch,
            args.seq_len, args.draft_lr, rng, args)
        round_trip_float16(draft)
        save_lm(draft, draft_config, draft_dir, target_dir)
    else:
        draft, draft_config = load_lm(draft_dir)
    draft.eval()

    # ---- MTP head
    if "mtp" in stages:
        mx.random.seed(args.seed + STAGE_SEED_OFFSETS["mtp"])
        if args.mtp_init is not None:
            head = load_mtp_head(args.mtp_init)
            if args.mtp_intermediate > head.args.intermediate_size:
                head = widen_mtp_head(head, args.mtp_intermediate)
        elif joint_head_dir.exists():
            # Start from the head pre-trained with the target; distillation then aligns
            # it with the finished (float16-rounded) target's own greedy choices.
            head = load_mtp_head(joint_head_dir)
        else:
            head = MTPHead(mtp_args)
            mx.eval(head.parameters())
        print(f"mtp head: {count_params(head)} params {head.args}, "
              f"init: {args.mtp_init or ('joint' if joint_head_dir.exists() else 'fresh')}", flush=True)
        rng = np.random.default_rng([args.seed, STAGE_SEED_OFFSETS["mtp"]])
        metrics["mtp_train_seconds"] = train_mtp(head, target, train_stream, rng, args)
        save_mtp_head(head, head.args, mtp_dir)  # an --mtp-init head keeps its shape unless widened
    # Always score the head as saved (float16 on disk, float32 in memory).
    head = load_mtp_head(mtp_dir)

    # ---- bars
    t0 = time.perf_counter()
    bars = evaluate(target, draft, head, windows, args.eval_batch)
    rollout_windows = windows[:: max(1, len(windows) // args.rollout_prompts)]
    rollouts = greedy_rollouts(target, rollout_windows, args.seq_len // 2,
                               args.seq_len // 2, args.eval_batch)
    bars.update(rollout_agreement(target, draft, head, rollouts, args.seq_len // 2,
                                  args.eval_batch))
    metrics["eval_seconds"] = time.perf_counter() - t0
    metrics["rollout_prompts"] = len(rollout_windows)
    metrics["eval_tokens"] = int(windows[:, 1:].size)
    metrics.update(bars)
    metrics.update({
        "target_params": count_params(target), "draft_params": count_params(draft),
        "mtp_params": count_params(head),
        "target_config": target_config, "draft_config": draft_config,
        "mtp_config": {k: v for k, v in head.args.__dict__.items()},
        "draft_to_target_param_ratio": count_params(draft) / count_params(target),
        "stages_trained": sorted(stages),
    })
    # Keep the training times of stages loaded rather than retrained this run.
    for key in ("tokenizer_train_seconds", "target_train_seconds",
                "draft_train_seconds", "mtp_train_seconds"):
        if key not in metrics and key in previous:
            metrics[key] = previous[key]
    # A fine-tuned head's lineage: each --mtp-init run appends its flags and its figure.
    history = list(previous.get("mtp_history", []))
    if "mtp" in stages and args.mtp_init is not None:
        history.append(f"{' '.join(sys.argv[1:])}: {bars['mtp_first_draft_agreement']:.3f}")
    if history:
        metrics["mtp_history"] = history
    metrics["script_seconds_this_run"] = time.perf_counter() - script_start_s
    weight_files = [target_dir / "model.safetensors", draft_dir / "model.safetensors",
                    mtp_dir / "model.safetensors"]
    metrics["weights_bytes_total"] = sum(f.stat().st_size for f in weight_files)
    write_json(metrics_path, metrics)

    print("\n==== bars (held-out files, %d tokens) ====" % metrics["eval_tokens"])
    print(f"target held-out loss        {bars['target_heldout_loss_nats']:.3f} nats/token "
          f"(bar <= 3.2) {'PASS' if bars['target_heldout_loss_nats'] <= 3.2 else 'FAIL'}")
    print(f"draft held-out loss         {bars['draft_heldout_loss_nats']:.3f} nats/token")
    print(f"draft greedy agreement      {bars['draft_agreement']:.3f}")
    print(f"mtp first-draft agreement   {bars['mtp_first_draft_agreement']:.3f} (bar >= 0.6) "
          f"{'PASS' if bars['mtp_first_draft_agreement'] >= 0.6 else 'FAIL'}")
    print(f"mtp second-draft agreement  {bars['mtp_second_draft_agreement']:.3f} "
          f"(given first accepted: "
          f"{bars['mtp_second_draft_agreement_given_first_accepted']:.3f})")
    print(f"mtp first draft on the greedy path of the text "
          f"{bars['mtp_first_draft_agreement_on_greedy_path']:.3f}")
    print(f"on greedy rollouts: draft acceptance {bars['rollout_draft_acceptance']:.3f}, "
          f"mtp first {bars['rollout_mtp_first_draft_acceptance']:.3f}, mtp second given "
          f"first {bars['rollout_mtp_second_draft_acceptance_given_first']:.3f}")
    print(f"weights on disk             {metrics['weights_bytes_total'] / 1e6:.1f} MB")
    print(f"params target {metrics['target_params']} draft {metrics['draft_params']} "
          f"mtp {metrics['mtp_params']}", flush=True)

    for name, model_dir in (("target", target_dir), ("draft", draft_dir)):
        for prompt, text in sample_generations(model_dir, ["def main(", "import os\n"],
                                               max_tokens=48).items():
            print(f"---- {name} sample for {prompt!r}:\n{prompt}{text}", flush=True)
    if math.isnan(bars["target_heldout_loss_nats"]):
        raise SystemExit("target loss is NaN")


if __name__ == "__main__":
    main()
