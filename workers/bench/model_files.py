"""The model files each benchmark target reads, made once and cached under CACHE_ROOT.

A `--model` value is the built-in folder, an mlx-lm folder, a .gguf file or the short name
`smollm2` (gmlx/models/source.py). gmlx and llama-server read a GGUF as it is; mlx_lm.server
needs an mlx-lm folder, so a GGUF is converted once with gmlx's own converter (`gmlx convert`).
The workload's tokenizer.json comes from that folder too, so every target tokenizes alike.
mlx_lm.server computes in the dtypes it finds on disk, so it gets a copy in the format gmlx
computes in on this machine (float32, or quantized weights with int8 or float32 activations).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from gmlx import config

logger = logging.getLogger(__name__)

CACHE_ROOT = Path(tempfile.gettempdir()) / "gmlx-bench-models"
# gmlx's CPU compute-format names (gmlx/models/compute_format.py), spelled here so that
# parsing a target spec imports no mlx.
FLOAT32, QUANTIZED = "float32", "quantized"


def model_source(model: str | None) -> Path:
    """The folder or .gguf file a `--model` value names (None: the built-in model)."""
    from gmlx.models.source import resolve_model_path  # imports no mlx

    return resolve_model_path(model)


def is_gguf(path: Path) -> bool:
    from gmlx.models.source import is_gguf_path

    return is_gguf_path(path)


def mlx_lm_folder(model: str | None, cache_root: Path = CACHE_ROOT) -> Path:
    """An mlx-lm folder holding `model`: the folder itself, or a GGUF converted once and cached."""
    source = model_source(model)
    return converted_folder(source, cache_root) if is_gguf(source) else source


def file_key(*paths: Path) -> str:
    """A short key that changes when any file is replaced or rewritten (path, size, mtime)."""
    parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def converted_folder(gguf_path: Path, cache_root: Path = CACHE_ROOT) -> Path:
    """`gmlx convert GGUF OUT/` done once per GGUF file (keyed by its path, size and mtime)."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ValueError(f"model {gguf_path}: no such GGUF file")
    dest = cache_root / f"{gguf_path.stem}-mlx-{file_key(gguf_path)}"
    if (dest / "config.json").exists():
        return dest
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()  # before gmlx.models.gguf imports mlx
    from gmlx.models.gguf import write_mlx_lm_folder

    logger.info("converting %s to an mlx-lm folder at %s", gguf_path, dest)
    return _publish(dest, lambda tmp: write_mlx_lm_folder(gguf_path, tmp))


def is_quantized_folder(folder: Path) -> bool:
    return "quantization" in _read_config(folder)


def gmlx_compute_format(folder: Path) -> str:
    """What gmlx computes this model in on the CPU backend: `float32` or `quantized`.

    Float models always compute in float32; a quantized one follows gmlx's own choice
    (GMLX_CPU_COMPUTE_FORMAT, else whether its quantized CPU kernels are active here).
    """
    if not is_quantized_folder(folder):
        return FLOAT32
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()
    from gmlx.models.compute_format import choose_cpu_compute_format

    return choose_cpu_compute_format()[0]


def gmlx_format(model: str | None) -> str:
    """What a gmlx target computes in here (the choice its worker makes at load, from the same settings)."""
    source = model_source(model)
    compute_format = gmlx_compute_format(mlx_lm_folder(model))
    shown = {FLOAT32: "float32", QUANTIZED: f"quantized weights, {config.cpu_quant_activations()} activations"}
    return f"{shown[compute_format]}" + (f", from GGUF {source.name}" if is_gguf(source) else "")


def mlx_lm_copy(src: Path, compute_format: str, cache_root: Path = CACHE_ROOT) -> Path:
    """A copy of an mlx-lm folder for mlx_lm.server in `compute_format` (same values).

    float32: every float tensor cast to float32 and quantized layers dequantized, what gmlx
    computes on CPU without its quantized kernels. quantized: quantized weights kept, float
    tensors (scales, biases, norms) cast to float32, as gmlx keeps them with its kernels.
    Cached by the source's weight files (path, size, mtime) and the format.
    """
    assert compute_format in (FLOAT32, QUANTIZED), compute_format
    src = Path(src).resolve()
    weight_files = sorted(src.glob("*.safetensors"))
    if not weight_files:
        raise ValueError(f"model {src}: no .safetensors files to copy")
    config = _read_config(src)
    is_dequantized = compute_format == FLOAT32 and "quantization" in config
    tag = "float32" if compute_format == FLOAT32 or "quantization" not in config else "quantized-f32scales"
    dest = cache_root / f"{src.name}-{tag}-{file_key(*weight_files)}"
    if (dest / "config.json").exists():
        return dest
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx

    def write(tmp: Path) -> None:
        for path in src.iterdir():
            if path.is_file() and path.suffix != ".safetensors":
                shutil.copy2(path, tmp / path.name)
        for path in weight_files:
            weights = mx.load(str(path))
            if is_dequantized:
                weights = _dequantized(mx, weights, config["quantization"])
            mx.save_safetensors(str(tmp / path.name), {
                k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()},
                metadata={"format": "mlx"})
        new_config = {k: v for k, v in config.items()
                      if not (is_dequantized and k in ("quantization", "quantization_config"))}
        (tmp / "config.json").write_text(json.dumps({**new_config, "torch_dtype": "float32"}, indent=2))

    return _publish(dest, write)


def _dequantized(mx, weights: dict, quantization: dict) -> dict:
    """Quantized modules (weight, scales, biases) replaced by their float32 weight."""
    out = dict(weights)
    for name in [k for k in weights if k.endswith(".scales")]:
        module = name[: -len(".scales")]
        params = quantization.get(module)
        params = params if isinstance(params, dict) else quantization
        biases = weights.get(f"{module}.biases")
        # float32 scales first, as gmlx casts them before dequantizing: the same values exactly.
        out[f"{module}.weight"] = mx.dequantize(weights[f"{module}.weight"], weights[name].astype(mx.float32),
                                                None if biases is None else biases.astype(mx.float32),
                                                group_size=params["group_size"], bits=params["bits"])
        del out[name]
        out.pop(f"{module}.biases", None)
    return out


def model_identity(source: Path) -> dict:
    """Which weights were measured: the folder or file and a digest of its weights."""
    digest = hashlib.sha1()
    for path in ([source] if is_gguf(source) else sorted(source.glob("*.safetensors"))):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return {"path": str(source), "weights_sha1": digest.hexdigest()[:12]}


def _read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model {folder}: no config.json")
    return json.loads(path.read_text())


def _publish(dest: Path, write) -> Path:
    """Write into a private temporary folder, then rename it into place (concurrent runs are safe)."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(dest)
    return dest
