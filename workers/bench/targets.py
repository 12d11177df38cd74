"""What a benchmark runs against, named by a spec string: KIND[:key=value,...].

  engine   the in-process Engine, stepped by the load generator's own loop
  server   a `gmlx serve` process on a loopback address, through ipc.client.AsyncClient
  mlx-lm   `mlx_lm.server` (OpenAI HTTP on loopback), streaming with plain http.client

Keys: drafter (none|mtp|draft[:PATH]|ngram), model (a folder), preempt (0|1), resume (0|1),
width_cap (N), num_draft_tokens (N), address (server: use one already running),
blas (mlx-lm: same|bundled), label. For example
  server:drafter=mtp,preempt=0     mlx-lm:drafter=draft     engine:drafter=none,label=plain
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

TARGET_KINDS = ("engine", "server", "mlx-lm")
_BOOL_KEYS = ("preempt", "resume")
_INT_KEYS = ("width_cap", "num_draft_tokens")
_STR_KEYS = ("drafter", "model", "address", "blas", "label")


@dataclass(frozen=True, slots=True)
class TargetSpec:
    kind: str
    drafter: str = "none"
    model: str | None = None  # None = the built-in model
    preempt: bool | None = None  # None = the engine default (on)
    resume: bool | None = None
    width_cap: int | None = None  # GMLX_MTP_WIDTH_CAP; None = the model's cap
    num_draft_tokens: int | None = None
    address: str | None = None  # server only: connect to this running server
    blas: str = "same"  # mlx-lm only: "same" loads gmlx's BLAS first, "bundled" runs it as installed
    label: str | None = None

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        parts = [self.kind, f"drafter={self.drafter}"]
        for key in ("preempt", "resume", "width_cap", "num_draft_tokens"):
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{key}={int(value)}")
        if self.kind == "mlx-lm" and self.blas != "same":
            parts.append(f"blas={self.blas}")
        return " ".join(parts)

    def gmlx_env(self) -> dict[str, str]:
        """The GMLX_* knobs this target sets (A/B switches read by the engine every round)."""
        env = {}
        if self.preempt is not None:
            env["GMLX_MTP_PREEMPT"] = "1" if self.preempt else "0"
        if self.resume is not None:
            env["GMLX_MTP_RESUME"] = "1" if self.resume else "0"
        if self.width_cap is not None:
            env["GMLX_MTP_WIDTH_CAP"] = str(self.width_cap)
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
        if spec.preempt is not None or spec.resume is not None or spec.width_cap is not None:
            raise ValueError(f"target {text!r}: preempt, resume and width_cap are gmlx knobs")
        if spec.blas not in ("same", "bundled"):
            raise ValueError(f"target {text!r}: blas must be same or bundled")
    if spec.address is not None and spec.kind != "server":
        raise ValueError(f"target {text!r}: address applies to server targets only")
    if spec.address is not None and not spec.address.startswith(("tcp://127.", "tcp://localhost", "ipc://")):
        raise ValueError(f"target {text!r}: only loopback addresses are allowed")
