"""Training pieces shared by train_builtin.py and train_mtp_head.py: schedules, optimizers,
the step driver, the chained MTP loss, and a tally for held-out scores."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np


def lr_schedule(peak_lr, total_steps, warmup_steps, min_lr_ratio):
    warmup = optim.linear_schedule(peak_lr / warmup_steps, peak_lr, warmup_steps)
    decay = optim.cosine_decay(peak_lr, max(total_steps - warmup_steps, 1),
                               end=peak_lr * min_lr_ratio)
    return optim.join_schedules([warmup, decay], [warmup_steps])


def make_adamw(peak_lr, total_steps, args):
    return optim.AdamW(
        learning_rate=lr_schedule(peak_lr, total_steps, args.warmup_steps, args.min_lr_ratio),
        betas=[0.9, 0.95],
        weight_decay=args.weight_decay,
    )


def make_mtp_optimizer(total_steps, args):
    """AdamW, or Muon for the head's matrices and AdamW for its norms (args.mtp_optimizer)."""
    if args.mtp_optimizer == "adamw":
        return make_adamw(args.mtp_lr, total_steps, args)
    muon = optim.Muon(
        learning_rate=lr_schedule(args.muon_lr, total_steps, args.warmup_steps,
                                  args.min_lr_ratio),
        momentum=0.95, weight_decay=0.0,
    )
    return optim.MultiOptimizer([muon, make_adamw(args.mtp_lr, total_steps, args)],
                                [lambda path, weight: weight.ndim == 2])


def run_steps(name: str, step: Callable, state, next_batch: Callable, steps: int,
              tokens_per_step: int, log_every: int) -> float:
    """Drive a compiled step over `next_batch()`; `step` returns one loss or a vector of
    loss terms. Returns wall seconds spent."""
    start_s = time.perf_counter()
    recent_losses = []
    for i in range(1, steps + 1):
        loss = step(*next_batch())
        mx.eval(loss, state)
        recent_losses.append(np.atleast_1d(np.array(loss)))
        if i % log_every == 0 or i == steps:
            elapsed_s = time.perf_counter() - start_s
            mean_losses = " ".join(f"{v:.3f}" for v in np.mean(recent_losses, axis=0))
            print(f"[{name}] step {i}/{steps} train_loss {mean_losses} "
                  f"{i * tokens_per_step / elapsed_s:.0f} tok/s {elapsed_s:.0f}s", flush=True)
            recent_losses = []
    return time.perf_counter() - start_s


def chained_mtp_loss(head, hidden, tokens, embed, chain_weight: float,
                     step_loss: Callable[[mx.array, int], mx.array]) -> mx.array:
    """hidden[:, t] and tokens[:, t+1] predict the teacher at t+1; the chained step feeds the
    head's own output back with x_{t+2}, as the drafter does. step_loss(predicted, offset)
    scores predicted (B, T - offset, D) against the teacher's positions offset.."""
    first = head(hidden[:, :-1], tokens[:, 1:], embed)
    loss = step_loss(first, 1)
    if chain_weight > 0:
        second = head(first[:, :-1], tokens[:, 2:], embed)
        loss = loss + chain_weight * step_loss(second, 2)
    return loss


class Tally:
    def __init__(self):
        self.sums = {}

    def add(self, name, numerator, denominator):
        num, den = self.sums.get(name, (0.0, 0))
        self.sums[name] = (num + float(numerator), den + int(denominator))

    def mean(self, name):
        num, den = self.sums[name]
        return num / max(den, 1)
