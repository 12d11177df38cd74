"""What a benchmark runs against, named by a spec string: KIND[:key=value,...].

  engine   the in-process Engine, stepped by the load generator's own loop
  server   a `gmlx serve` process on a loopback address, through ipc.client.AsyncClient
  mlx-lm   `mlx_lm.server` (OpenAI HTTP on loopback), streaming with plain http.client
  llama-server  llama.cpp's `llama-server -np N` on a GGUF (scripts/build_llama_cpp.sh builds it),
           streaming token-id prompts to /completion with plain http.client

Keys: drafter (none|mtp|draft[:PATH]|ngram), model (a folder, a .gguf file or smollm2), preempt (0|1),
resume (0|1), adaptive (0|1: 0 drafts the fixed k every round), evidence (0|1: 0 sets depths without
the drafter's per-round grades), amx (0|1: GMLX_CPU_AMX, the CPU kernels' wide products on AMX),
kv (auto|model|float16: GMLX_KV_DTYPE, the KV cache's element type), kv_mb (N: GMLX_KV_CACHE_MB, the KV
budget), kv_reserve (N: GMLX_KV_RESERVE_TOKENS, a row's growth reserved; 0 its whole max_tokens), width_cap (N),
packing (0|1: GMLX_PREFILL_PACKING, prompt chunks inside the decode forward), num_draft_tokens (N),
address (server: use one already running),
blas (mlx-lm: same|bundled), format (mlx-lm: auto|float32|quantized; auto = what gmlx computes in here),
gguf (llama-server: the file; default the model's GGUF), np (llama-server: slots; default the
concurrency), ctx (llama-server: context tokens per slot), repack (llama-server: 0 runs it with
--no-repack; default llama.cpp's, on), label. For example
  server:drafter=mtp,preempt=0     mlx-lm:drafter=draft     engine:drafter=none,label=plain
  llama-server:np=8,gguf=/tmp/SmolLM2-135M-Instruct.F32.gguf,label=llama.cpp-f32
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gmlx.config import KV_CACHE_DTYPES, ROW_ATTENTION_RULES

TARGET_KINDS = ("engine", "server", "mlx-lm", "llama-server")
_BOOL_KEYS = ("preempt", "resume", "adaptive", "evidence", "row_invariance", "repack", "amx", "packing")
_INT_KEYS = ("width_cap", "num_draft_tokens", "num_slots", "slot_context_tokens", "kv_mb", "kv_reserve")
_STR_KEYS = ("drafter", "model", "address", "blas", "format", "gguf", "label", "row_attention", "kv")
_KEY_ALIASES = {"np": "num_slots", "ctx": "slot_context_tokens"}  # llama-server's own flag names
MLX_LM_FORMATS = ("auto", "float32", "quantized")
_GMLX_KNOBS = ("preempt", "resume", "adaptive", "evidence", "width_cap", "num_draft_tokens", "row_invariance",
               "row_attention", "amx", "kv", "kv_mb", "kv_reserve", "packing")
DEFAULT_SLOT_CONTEXT_TOKENS = 2048  # llama-server allocates each slot's KV cache up front


@dataclass(frozen=True, slots=True)
class TargetSpec:
    kind: str
    drafter: str | None = None  # None = the target's own default: engine none, server ngram; mlx-lm plain
    model: str | None = None  # None = the built-in model
    preempt: bool | None = None  # None = the engine default (on)
    resume: bool | None = None
    adaptive: bool | None = None  # GMLX_ADAPTIVE_DEPTH; None = the engine default (on)
    evidence: bool | None = None  # GMLX_DRAFT_EVIDENCE; None = the engine default (on)
    width_cap: int | None = None  # GMLX_MTP_WIDTH_CAP; None = the model's cap
    row_invariance: bool | None = None  # GMLX_ROW_INVARIANCE at load; None = auto (on a GPU only)
    row_attention: str | None = None  # GMLX_ROW_ATTENTION at load (masked|unmasked); None = masked
    amx: bool | None = None  # GMLX_CPU_AMX; None = the kernels' default (on where the CPU allows)
    kv: str | None = None  # GMLX_KV_DTYPE (auto|model|float16); None = the server's default (auto)
    kv_mb: int | None = None  # GMLX_KV_CACHE_MB; None = the server's default budget
    kv_reserve: int | None = None  # GMLX_KV_RESERVE_TOKENS; None = the server's default (256)
    packing: bool | None = None  # GMLX_PREFILL_PACKING; None = the engine's choice by the model
    num_draft_tokens: int | None = None
    address: str | None = None  # server only: connect to this running server
    blas: str = "same"  # mlx-lm only: "same" loads gmlx's BLAS first, "bundled" runs it as installed
    format: str = "auto"  # mlx-lm only: the weights' compute format; auto = gmlx's choice here
    gguf: str | None = None  # llama-server only: None = the model's GGUF
    num_slots: int | None = None  # llama-server only (-np): None = the workload's concurrency
    slot_context_tokens: int = DEFAULT_SLOT_CONTEXT_TOKENS  # llama-server only: -c is this x slots
    # llama-server only: its weight repacking (AMX and other CPU layouts); None = llama.cpp's default.
    # On some AMX boxes llama-server dies at start with it on, where llama-bench runs.
    repack: bool | None = None
    label: str | None = None

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.kind == "llama-server":
            parts = [self.kind] + ([f"np={self.num_slots}"] if self.num_slots is not None else [])
            parts += [f"repack={int(self.repack)}"] if self.repack is not None else []
            return " ".join(parts + ([f"gguf={Path(self.gguf).name}"] if self.gguf else []))
        shown_drafter = self.drafter or ("none" if self.kind == "mlx-lm" else "default")
        parts = [self.kind, f"drafter={shown_drafter}"]
        for key in _GMLX_KNOBS:
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{key}={value if isinstance(value, str) else int(value)}")
        if self.kind == "mlx-lm" and self.blas != "same":
            parts.append(f"blas={self.blas}")
        if self.kind == "mlx-lm" and self.format != "auto":
            parts.append(f"format={self.format}")
        return " ".join(parts)

    def gmlx_env(self) -> dict[str, str]:
        """The GMLX_* knobs this target sets (A/B switches the engine reads every round, and at load)."""
        env = {}
        if self.preempt is not None:
            env["GMLX_MTP_PREEMPT"] = "1" if self.preempt else "0"
        if self.resume is not None:
            env["GMLX_MTP_RESUME"] = "1" if self.resume else "0"
        if self.adaptive is not None:
            env["GMLX_ADAPTIVE_DEPTH"] = "1" if self.adaptive else "0"
        if self.evidence is not None:
            env["GMLX_DRAFT_EVIDENCE"] = "1" if self.evidence else "0"
        if self.width_cap is not None:
            env["GMLX_MTP_WIDTH_CAP"] = str(self.width_cap)
        if self.row_invariance is not None:
            env["GMLX_ROW_INVARIANCE"] = "1" if self.row_invariance else "0"
        if self.row_attention is not None:
            env["GMLX_ROW_ATTENTION"] = self.row_attention
        if self.amx is not None:
            env["GMLX_CPU_AMX"] = "1" if self.amx else "0"
        if self.kv is not None:
            env["GMLX_KV_DTYPE"] = self.kv
        if self.kv_mb is not None:
            env["GMLX_KV_CACHE_MB"] = str(self.kv_mb)
        if self.kv_reserve is not None:
            env["GMLX_KV_RESERVE_TOKENS"] = str(self.kv_reserve)
        if self.packing is not None:
            env["GMLX_PREFILL_PACKING"] = "1" if self.packing else "0"
        return env

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self)}


def parse_target(text: str, defaults: dict | None = None) -> TargetSpec:
    """'server:drafter=mtp,preempt=0' -> TargetSpec; defaults fill keys the text leaves out."""
    kind, _, rest = text.strip().partition(":")
    if kind not in TARGET_KINDS:
        raise ValueError(f"target {text!r}: kind must be one of {', '.join(TARGET_KINDS)}")
    fields = {k: v for k, v in (defaults or {}).items() if v is not None}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        key = _KEY_ALIASES.get(key, key)
        if not sep:
            raise ValueError(f"target {text!r}: {item!r} is not key=value")
        fields[key] = _parse_value(text, key, value.strip())
    spec = replace(TargetSpec(kind), **fields)
    _check(text, spec)
    return spec


def _parse_value(text: str, key: str, value: str):
    if key in _BOOL_KEYS:
        if value not in ("0", "1"):
            raise ValueError(f"target {text!r}: {key} must be 0 or 1")
        return value == "1"
    if key in _INT_KEYS:
        if not value.isdigit():
            raise ValueError(f"target {text!r}: {key} must be an integer >= 0")
        return int(value)
    if key in _STR_KEYS:
        return value
    raise ValueError(f"target {text!r}: unknown key {key!r}")


def _check(text: str, spec: TargetSpec) -> None:
    from gmlx.drafters import parse_drafter  # imports no mlx

    kind, _ = parse_drafter(spec.drafter)
    if spec.kind == "mlx-lm":
        if kind not in ("none", "draft"):
            raise ValueError(f"target {text!r}: mlx-lm drafts only with a draft model (drafter=draft[:PATH])")
        if _gmlx_knobs(spec) - {"num_draft_tokens"}:
            raise ValueError(f"target {text!r}: {', '.join(k for k in _GMLX_KNOBS if k != 'num_draft_tokens')} "
                             "are gmlx knobs")
        if spec.blas not in ("same", "bundled"):
            raise ValueError(f"target {text!r}: blas must be same or bundled")
    if spec.kind != "mlx-lm" and (spec.blas != "same" or spec.format != "auto"):
        raise ValueError(f"target {text!r}: blas and format apply to mlx-lm targets only")
    if spec.row_attention not in (None, *ROW_ATTENTION_RULES):
        raise ValueError(f"target {text!r}: row_attention must be one of {', '.join(ROW_ATTENTION_RULES)}")
    if spec.kv not in (None, *KV_CACHE_DTYPES):
        raise ValueError(f"target {text!r}: kv must be one of {', '.join(KV_CACHE_DTYPES)}")
    if spec.kv_mb == 0:
        raise ValueError(f"target {text!r}: kv_mb must be > 0 (leave it out for the server's default budget)")
    if spec.format not in MLX_LM_FORMATS:
        raise ValueError(f"target {text!r}: format must be one of {', '.join(MLX_LM_FORMATS)}")
    _check_llama_server(text, spec, kind)
    if spec.address is not None and spec.kind != "server":
        raise ValueError(f"target {text!r}: address applies to server targets only")
    if spec.address is not None and not spec.address.startswith(("tcp://127.", "tcp://localhost", "ipc://")):
        raise ValueError(f"target {text!r}: only loopback addresses are allowed")


def _gmlx_knobs(spec: TargetSpec) -> set[str]:
    """The engine knobs a target sets: only gmlx's own targets take them."""
    return {key for key in _GMLX_KNOBS if getattr(spec, key) is not None}


def _check_llama_server(text: str, spec: TargetSpec, drafter_kind: str) -> None:
    is_llama = spec.kind == "llama-server"
    if not is_llama and (spec.gguf is not None or spec.num_slots is not None or spec.repack is not None
                         or spec.slot_context_tokens != DEFAULT_SLOT_CONTEXT_TOKENS):
        raise ValueError(f"target {text!r}: gguf, np, ctx and repack apply to llama-server targets only")
    if not is_llama:
        return
    if drafter_kind != "none":
        raise ValueError(f"target {text!r}: llama-server runs without a drafter here (drafter=none)")
    if _gmlx_knobs(spec):
        raise ValueError(f"target {text!r}: {', '.join(_GMLX_KNOBS)} are gmlx knobs")
    if spec.gguf is not None and not spec.gguf.lower().endswith(".gguf"):
        raise ValueError(f"target {text!r}: gguf must name a .gguf file, got {spec.gguf!r}")
    if spec.num_slots == 0 or spec.slot_context_tokens == 0:
        raise ValueError(f"target {text!r}: np and ctx must be >= 1")
