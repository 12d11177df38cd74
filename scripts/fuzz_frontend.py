"""Fuzz a live `gmlx serve` with named classes of client frames (scripts/frames.py).

Each frame is followed by a STATS probe; the replies before the probe's answer are the
frame's. Prints a table of class -> outcomes and first-reply times, and the totals that
matter: front-end crashes, hangs, and valid requests not served. A crash restarts the
server so the run goes on; the exit code is 1 if anything went wrong.

    python scripts/fuzz_frontend.py                       # 10,000 frames, the built-in model
    python scripts/fuzz_frontend.py --num 50000 --time-limit-s 3600 --drafter ngram
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO_ROOT), str(_REPO_ROOT / "scripts")]  # this checkout's ipc/, not an installed one

import zmq  # noqa: E402

import frames  # noqa: E402
from serving_support import Server, model_dir  # noqa: E402

OUTCOMES = ("served", "stats", "answered", "error+ref", "error", "silent", "failed_after_accept", "gap", "bad_logprobs", "hang")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=10_000, help="frames to send")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="stop early after this long")
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    args = parser.parse_args()

    model = Path(args.model) if args.model else model_dir()
    rng = random.Random(args.seed)
    outcomes = collections.defaultdict(collections.Counter)
    reply_ms = collections.defaultdict(list)
    problems: list[str] = []
    num_crashes, num_sent = 0, 0
    start_s = time.monotonic()
    server, prober, sock = _start(model, args.drafter)
    try:
        while num_sent < args.num and time.monotonic() - start_s < args.time_limit_s:
            frame = frames.draw(rng)
            seen = prober.observe(frame)
            num_sent += 1
            outcomes[frame.name][seen.outcome] += 1
            if seen.first_reply_s is not None:
                reply_ms[frame.name].append(seen.first_reply_s * 1000)
            problem = _problem(frame, seen)
            if problem:
                problems.append(f"#{num_sent} {frame.name}: {problem} ({bytes(frame.frames[-1])[:80]!r})")
            if server.proc.poll() is not None or seen.outcome == "hang":
                num_crashes += server.proc.poll() is not None
                problems.append(f"#{num_sent} {frame.name}: server exit code {server.proc.poll()}\n{server.log()}")
                sock.close()
                server.kill()
                server, prober, sock = _start(model, args.drafter)
    finally:
        sock.close()
        server.kill()
    elapsed_s = time.monotonic() - start_s
    _print_table(outcomes, reply_ms)
    num_valid = sum(outcomes[n][o] for n in ("valid_generate", "valid_stats", "valid_tokenize") for o in OUTCOMES)
    num_valid_served = (outcomes["valid_generate"]["served"] + outcomes["valid_stats"]["stats"]
                        + outcomes["valid_tokenize"]["answered"])
    print(f"\n{num_sent} frames in {elapsed_s:.0f} s; front-end crashes: {num_crashes}; "
          f"hangs: {sum(c['hang'] for c in outcomes.values())}; "
          f"valid requests served: {num_valid_served}/{num_valid}")
    for line in problems[:20]:
        print("PROBLEM", line)
    return 1 if problems else 0


def _start(model: Path, drafter: str):
    server = Server(model=model, drafter=drafter)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    return server, frames.Prober(sock), sock


def _problem(frame: frames.FuzzFrame, seen: frames.Observation) -> str | None:
    if seen.outcome in ("hang", "gap", "failed_after_accept", "bad_logprobs"):
        return seen.outcome
    if frame.is_valid and seen.outcome not in frames.SERVED:
        return f"a valid request got {seen.outcome}"
    if frame.name in frames.ALWAYS_REFUSED and seen.outcome not in ("error", "error+ref"):
        return f"a hostile frame got {seen.outcome}"
    return None


def _print_table(outcomes, reply_ms) -> None:
    used = [o for o in OUTCOMES if any(c[o] for c in outcomes.values())]
    print("| class | frames | " + " | ".join(used) + " | median reply ms | max reply ms |")
    print("|---" * (len(used) + 4) + "|")
    for name in frames.CLASSES:
        counts = outcomes.get(name)
        if not counts:
            continue
        times = reply_ms.get(name) or [float("nan")]
        cells = " | ".join(str(counts[o]) for o in used)
        print(f"| {name} | {sum(counts.values())} | {cells} | {statistics.median(times):.2f} | {max(times):.2f} |")


if __name__ == "__main__":
    sys.exit(main())
