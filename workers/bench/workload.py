"""What a benchmark sends: prompts, output lengths and arrival times, all seeded.

Prompts are cut from the standard-library files the built-in model never trained on
(scripts/train_builtin.py holds out whole files by a hash of their path), so acceptance
rates are those of unseen text. Prompts are text: every target tokenizes them itself, the
same way, so all targets decode the same token sequences.
"""

from __future__ import annotations

import functools
import math
import random
import sysconfig
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

LOAD_KINDS = ("closed", "poisson", "burst", "scripted")
PROMPT_SOURCES = ("heldout", "random")
HELDOUT_PER_MILLE = 30  # scripts/train_builtin.py --heldout-per-mille default
MAX_SOURCE_FILE_BYTES = 512 * 1024  # the training script skips larger files


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    prompt: str
    max_tokens: int
    arrival_s: float | None = None  # seconds after the run starts; None = closed loop
    group: str = "main"  # "long" / "arrival" in the scripted load


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # closed | poisson | burst | scripted
    requests: tuple[RequestSpec, ...]
    concurrency: int | None = None  # closed loop only: requests in flight
    temperature: float = 0.0
    settings: dict = field(default_factory=dict)  # how it was made, for the results
    is_ignore_eos: bool = False  # every request runs to its max_tokens (EOS ends nothing)

    @property
    def is_open_loop(self) -> bool:
        return self.concurrency is None

    def describe(self) -> dict:
        return {"kind": self.kind, "concurrency": self.concurrency, "num_requests": len(self.requests),
                "temperature": self.temperature, "ignore_eos": self.is_ignore_eos, **self.settings}


# --- length distributions --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Lengths:
    """fixed:N | uniform:A,B | lognormal:MEDIAN,SIGMA[,MAX]; a bare N means fixed:N."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str, name: str = "length") -> Lengths:
        kind, _, rest = str(text).strip().partition(":")
        if not rest and kind.isdigit():
            kind, rest = "fixed", kind
        try:
            params = tuple(float(x) for x in rest.split(",")) if rest else ()
        except ValueError:
            raise ValueError(f"{name} {text!r}: parameters must be numbers") from None
        expected = {"fixed": (1,), "uniform": (2,), "lognormal": (2, 3)}
        if kind not in expected:
            raise ValueError(f"{name} {text!r}: expected fixed:N, uniform:A,B or lognormal:MEDIAN,SIGMA[,MAX]")
        if len(params) not in expected[kind] or any(p <= 0 for p in params):
            raise ValueError(f"{name} {text!r}: wrong number of parameters, or one is <= 0")
        if kind == "uniform" and params[0] > params[1]:
            raise ValueError(f"{name} {text!r}: A must be <= B")
        return cls(kind, params)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.params[0])
        if self.kind == "uniform":
            return rng.randint(int(self.params[0]), int(self.params[1]))
        median, sigma = self.params[:2]
        upper = self.params[2] if len(self.params) == 3 else median * 8
        return max(1, min(int(upper), round(median * math.exp(rng.gauss(0.0, sigma)))))

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{p:g}" for p in self.params)


# --- prompts ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def heldout_files(per_mille: int = HELDOUT_PER_MILLE) -> tuple[Path, ...]:
    """The stdlib .py files the built-in model did not train on, in a stable order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if "site-packages" in rel.parts or "__pycache__" in rel.parts:
            continue
        if path.is_file() and path.stat().st_size <= MAX_SOURCE_FILE_BYTES and \
                zlib.crc32(rel.as_posix().encode()) % 1000 < per_mille:
            files.append(path)
    return tuple(sorted(files, key=lambda p: p.relative_to(stdlib).as_posix()))


class PromptMaker:
    """Prompts of about N tokens: line-aligned held-out source, or random tokens."""

    def __init__(self, tokenizer_file: Path, source: str = "heldout", seed: int = 0):
        from tokenizers import Tokenizer  # the fast tokenizer alone: no mlx, no transformers

        if source not in PROMPT_SOURCES:
            raise ValueError(f"prompt source {source!r}: expected one of {', '.join(PROMPT_SOURCES)}")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.source = source
        self.rng = random.Random(seed)
        self._files = heldout_files() if source == "heldout" else ()
        self._lines: dict[Path, list[str]] = {}
        if source == "heldout" and not self._files:
            raise ValueError("no held-out standard-library files found for prompts")

    def make(self, num_tokens: int) -> str:
        return self._heldout(num_tokens) if self.source == "heldout" else self._random(num_tokens)

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def _heldout(self, num_tokens: int) -> str:
        for _ in range(64):
            lines = self._read(self.rng.choice(self._files))
            if len(lines) < 4:
                continue
            start = self.rng.randrange(len(lines))
            text = ""
            for line in lines[start:]:
                text += line
                if len(text) >= 2 * num_tokens and self.num_tokens(text) >= num_tokens:
                    break
            ids = self.tokenizer.encode(text).ids
            if len(ids) >= max(1, num_tokens // 2):
                return self.tokenizer.decode(ids[:num_tokens])
        raise ValueError(f"could not cut a {num_tokens}-token prompt from the held-out files")

    def _random(self, num_tokens: int) -> str:
        vocab = self.tokenizer.get_vocab_size()
        ids = [self.rng.randrange(1, vocab) for _ in range(num_tokens)]
        return self.tokenizer.decode(ids) or "x"

    def _read(self, path: Path) -> list[str]:
        if path not in self._lines:
            try:
                self._lines[path] = path.read_text(encoding="utf-8").splitlines(keepends=True)
            except (OSError, UnicodeDecodeError):
                self._lines[path] = []
        return self._lines[path]


# --- arrivals ---------------------------------------------------------------------------

def poisson_arrivals(num: int, rate_per_s: float, rng: random.Random) -> list[float]:
    if rate_per_s <= 0:
        raise ValueError(f"rate must be > 0, got {rate_per_s}")
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def burst_arrivals(num: int, burst_size: int, interval_s: float) -> list[float]:
    if burst_size <= 0 or interval_s < 0:
        raise ValueError("burst size must be > 0 and the interval >= 0")
    return [(i // burst_size) * interval_s for i in range(num)]


@dataclass(slots=True)
class WorkloadOptions:
    kind: str = "closed"
    num_requests: int = 16
    concurrency: int = 8  # closed loop
    requests_per_client: int | None = None  # closed loop: if set, num_requests = this x concurrency
    rate_per_s: float = 2.0  # poisson
    burst_size: int = 4  # burst
    burst_interval_s: float = 2.0
    long_max_tokens: int = 256  # scripted: the lone stream's budget
    arrival_delay_s: float = 1.0  # scripted: when the first arrival comes
    arrival_interval_s: float = 0.25  # scripted: gap between arrivals
    prompt_source: str = "heldout"
    prompt_tokens: str = "uniform:32,96"
    max_tokens: str = "64"
    temperature: float = 0.0
    seed: int = 0
    is_ignore_eos: bool = False  # fixed-length answers: each request decodes its whole max_tokens


def make_workload(options: WorkloadOptions, tokenizer_file: Path) -> Workload:
    """Build the requests; the same options and seed give the same workload."""
    o = options
    if o.kind not in LOAD_KINDS:
        raise ValueError(f"load {o.kind!r}: expected one of {', '.join(LOAD_KINDS)}")
    if o.kind == "closed" and o.requests_per_client:
        o = replace(o, num_requests=o.requests_per_client * o.concurrency)
    if o.num_requests <= 0:
        raise ValueError(f"num_requests must be > 0, got {o.num_requests}")
    prompt_lengths = Lengths.parse(o.prompt_tokens, "prompt_tokens")
    output_lengths = Lengths.parse(o.max_tokens, "max_tokens")
    rng = random.Random(o.seed)
    maker = PromptMaker(tokenizer_file, o.prompt_source, seed=o.seed)
    arrivals: list[float | None]
    groups = ["main"] * o.num_requests
    if o.kind == "closed":
        if o.concurrency <= 0:
            raise ValueError(f"concurrency must be > 0, got {o.concurrency}")
        arrivals = [None] * o.num_requests
    elif o.kind == "poisson":
        arrivals = poisson_arrivals(o.num_requests, o.rate_per_s, rng)
    elif o.kind == "burst":
        arrivals = burst_arrivals(o.num_requests, o.burst_size, o.burst_interval_s)
    else:  # one long stream alone, then arrivals while it decodes
        arrivals = [0.0] + [o.arrival_delay_s + i * o.arrival_interval_s for i in range(o.num_requests - 1)]
        groups = ["long"] + ["arrival"] * (o.num_requests - 1)
    requests = []
    for i, (arrival_s, group) in enumerate(zip(arrivals, groups)):
        max_tokens = o.long_max_tokens if group == "long" else output_lengths.sample(rng)
        prompt = maker.make(prompt_lengths.sample(rng))
        requests.append(RequestSpec(i, prompt, max_tokens, arrival_s, group))
    relevant = {"closed": ("requests_per_client",), "poisson": ("rate_per_s",),
                "burst": ("burst_size", "burst_interval_s"),
                "scripted": ("long_max_tokens", "arrival_delay_s", "arrival_interval_s")}[o.kind]
    count = () if o.kind == "closed" and o.requests_per_client else ("num_requests",)
    settings = {k: getattr(o, k) for k in (*count, *relevant, "prompt_source", "prompt_tokens", "max_tokens",
                                           "seed")}
    return Workload(o.kind, tuple(requests), o.concurrency if o.kind == "closed" else None,
                    o.temperature, settings, o.is_ignore_eos)
