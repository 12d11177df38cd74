"""Workers killed at random under load: is anything lost, and is every stream still exact?

    python3 scripts/chaos_workers.py --duration-s 120 --kill-every-s 8 --clients 6
    python3 scripts/chaos_workers.py --model smollm2 --duration-s 120 --kill-every-s 15

A `gmlx serve` with --workers 2 and its default drafter serves client threads that send seeded
requests (greedy and sampled, prompts cut from real source text, mixed lengths) without pause.
A killer SIGKILLs one of the ready workers every --kill-every-s seconds (at random within
+-50%). Afterwards every finished stream is checked against solo plain decoding of the same
request in this process; requests that outlived MAX_WORKER_LOSSES workers are counted apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO_ROOT), str(_REPO_ROOT / "scripts")]

from ipc.client import Client, RequestError  # noqa: E402
from serving_support import Server, model_dir, solo  # noqa: E402


def client_loop(address: str, prompts: list[list[int]], seed: int, stop: threading.Event, done: list) -> None:
    rng = random.Random(seed)
    with Client(address, timeout_s=120) as client:
        while not stop.is_set():
            request = dict(token_ids=rng.choice(prompts), max_tokens=rng.randint(16, 200),
                           temperature=rng.choice([0.0, 0.8]), seed=rng.getrandbits(32))
            tokens, last, error = [], None, None
            try:
                for chunk in client.generate(**request):
                    tokens += chunk.token_ids
                    last = chunk
            except (RequestError, TimeoutError) as e:
                error = str(e)
            done.append((request, tokens, last.finish_reason if error is None else None,
                         last.stats if error is None else None, error))


def killer_loop(server: Server, every_s: float, seed: int, stop: threading.Event, kills: list) -> None:
    rng = random.Random(seed)
    while not stop.wait(every_s * rng.uniform(0.5, 1.5)):
        with Client(server.address, timeout_s=30) as client:
            busy = [w["pid"] for w in client.stats()["workers"] if w["pid"] is not None]
        if busy:
            pid = rng.choice(busy)
            os.kill(pid, signal.SIGKILL)
            kills.append((time.monotonic(), pid))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--kill-every-s", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--model", default=None, help="a model folder, .gguf or smollm2 (default: built-in)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = parser.parse_args()

    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()
    from gmlx.config import EngineConfig
    from gmlx.engine import Engine

    reference = Engine.load(EngineConfig(model_path=args.model, drafter="none", prompt_cache_bytes=0))
    ids = reference.tokenizer.encode(Path(json.__file__).read_text())
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(64):
        start = rng.randrange(len(ids) - 300)
        prompts.append(ids[start : start + rng.randint(2, 300)])

    server = Server(model=args.model or model_dir(), drafter=None, num_workers=2)
    done, kills = [], []
    stop = threading.Event()
    try:
        threads = [threading.Thread(target=client_loop, args=(server.address, prompts, args.seed + i, stop, done))
                   for i in range(args.clients)]
        threads.append(threading.Thread(target=killer_loop, args=(server, args.kill_every_s, args.seed, stop, kills)))
        for thread in threads:
            thread.start()
        time.sleep(args.duration_s)
        stop.set()
        for thread in threads:
            thread.join(180)
        with Client(server.address, timeout_s=30) as client:
            stats = client.stats()
        server.terminate()
    finally:
        stop.set()
        if server.proc.poll() is None:
            server.kill()

    finished = [d for d in done if d[4] is None]
    errors = [d[4] for d in done if d[4] is not None]
    mismatched = []
    for request, tokens, reason, _, _ in finished:
        if (tokens, reason) != solo(reference, **request):
            mismatched.append(request)
    carried = [d for d in finished if d[3]["num_worker_losses"] > 0]
    summary = {"duration_s": args.duration_s, "clients": args.clients, "kills": len(kills),
               "requests_finished": len(finished), "finished_after_a_worker_loss": len(carried),
               "equal_to_solo": len(finished) - len(mismatched), "mismatched": len(mismatched),
               "errors": len(errors), "lost_past_the_bound": sum("was lost" in e for e in errors),
               "num_carried_over": stats.get("num_carried_over"), "num_worker_restarts": stats.get("num_worker_restarts"),
               "tokens": sum(len(d[1]) for d in finished)}
    print(json.dumps(summary, indent=1))
    for e in sorted(set(errors))[:5]:
        print("error:", e)
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    return 1 if mismatched or len(errors) > summary["lost_past_the_bound"] else 0


if __name__ == "__main__":
    sys.exit(main())
