"""Model folders for benchmarks: random-weight models and the inert-grown built-in model.

The inert-grown model is the built-in target with extra MLP units whose down-projection
columns are zero and extra layers whose attention and MLP output projections are zero.
They do real work (the matmuls run) but write nothing to the residual stream, so the
verify and draft costs are those of a larger model while acceptance rates stay the real
ones of the trained model. Its numbers are labelled "inert-grown" wherever they appear.
"""

from __future__ import annotations

import json
from pathlib import Path

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
import mlx.core as mx
import numpy as np

from gmlx.config import BUILTIN_TARGET_DIR
from gmlx.models.random_model import builtin_vocab_size, copy_tokenizer, make_random_model_dir

def make_random_model(folder: Path, hidden_size: int = 1024, num_layers: int = 8,
                      intermediate_size: int = 4096, seed: int = 0) -> Path:
    """A random-weight qwen3 model with the built-in tokenizer (float32 on disk)."""
    config = dict(model_type="qwen3", hidden_size=hidden_size, num_hidden_layers=num_layers,
                  intermediate_size=intermediate_size, num_attention_heads=hidden_size // 64,
                  num_key_value_heads=max(1, hidden_size // 256), head_dim=64, rms_norm_eps=1e-6,
                  vocab_size=builtin_vocab_size(), max_position_embeddings=4096, rope_theta=10000.0,
                  tie_word_embeddings=True)
    return make_random_model_dir(folder, config, seed)


def grow_inert(folder: Path, intermediate_size: int, num_extra_layers: int, src: Path = BUILTIN_TARGET_DIR) -> Path:
    """The built-in target grown with inert parameters (see the module docstring)."""
    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(src / "model.safetensors")).items()}
    num_layers, old_inter = config["num_hidden_layers"], config["intermediate_size"]
    assert intermediate_size >= old_inter
    rng = np.random.default_rng(0)
    extra = intermediate_size - old_inter
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj"):  # (I, D): extra units read the input for real
            w = weights[p + name + ".weight"]
            weights[p + name + ".weight"] = np.concatenate([w, rng.normal(0, 0.02, (extra, w.shape[1]))]).astype(np.float32)
        w = weights[p + "down_proj.weight"]  # (D, I): their outputs are multiplied by zero
        weights[p + "down_proj.weight"] = np.concatenate([w, np.zeros((w.shape[0], extra), np.float32)], axis=1)
    for j in range(num_extra_layers):
        src_prefix, dst_prefix = f"model.layers.{j % num_layers}.", f"model.layers.{num_layers + j}."
        for key in [k for k in list(weights) if k.startswith(src_prefix)]:
            value = weights[key].copy()
            if key.endswith(("o_proj.weight", "down_proj.weight")):
                value[:] = 0.0  # the layer's residual writes are zero
            weights[dst_prefix + key[len(src_prefix):]] = value
    config.update(num_hidden_layers=num_layers + num_extra_layers, intermediate_size=intermediate_size)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    (folder / "config.json").write_text(json.dumps(config))
    copy_tokenizer(src, folder)
    return folder


def forward_ms(target, num_rows: int = 1, context_tokens: int = 256, repeats: int = 10,
               num_positions: int = 1) -> float:
    """Median wall time of one forward of num_positions tokens per row (1: a decode step;
    k+1: a verify) at this width, with a KV cache of context_tokens."""
    import time

    from gmlx.cache.ragged import make_ragged_cache

    caches = make_ragged_cache(target.num_layers, num_rows, stored_dtype=target.kv_dtype)
    target.forward(mx.zeros((num_rows, context_tokens), dtype=mx.int32), caches)
    mx.eval([c.keys for c in caches])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        hidden, logits = target.forward(mx.zeros((num_rows, num_positions), dtype=mx.int32), caches)
        mx.eval(logits)
        times.append(time.perf_counter() - start)
        for c in caches:
            c.trim(num_positions)
    return 1e3 * float(np.median(times))


def heldout_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """Prompts cut from stdlib files the built-in model never trained on (train_builtin's rule)."""
    import sysconfig
    import zlib

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if "site-packages" not in p.parts and zlib.crc32(p.relative_to(stdlib).as_posix().encode()) % 1000 < 30)
    prompts = []
    for path in files:
        tokens = tokenizer.encode(path.read_text(errors="replace"))
        for start in range(0, len(tokens) - num_tokens, 4 * num_tokens):
            prompts.append(tokens[start : start + num_tokens])
            if len(prompts) == num_prompts:
                return prompts
    assert prompts, "no held-out files found"
    return (prompts * num_prompts)[:num_prompts]


def heldout_text_prompts(tokenizer, kind: str, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """Prompts from the files train_mtp_head.py held out: kind `prose` (man pages, licenses,
    READMEs) or `code` (stdlib sources), one per file, from each file's middle."""
    from text_corpus import read_text, split_code_files, split_prose_files

    files = (split_prose_files if kind == "prose" else split_code_files)()[1]
    prompts = []
    for path in files:
        tokens = tokenizer.encode(read_text(path) or "")
        if len(tokens) >= 2 * num_tokens:
            middle = len(tokens) // 2
            prompts.append(tokens[middle : middle + num_tokens])
        if len(prompts) == num_prompts:
            return prompts
    assert prompts, f"no held-out {kind} files long enough"
    return (prompts * num_prompts)[:num_prompts]


def decode_tok_per_s(engine, prompts, params) -> tuple[float, dict]:
    """Aggregate decode tokens/s of `prompts` run together, from after the first step."""
    import time

    for p in prompts:
        engine.add_request(p, params)
    engine.step()
    before = dict(engine.counters)
    start, count = time.perf_counter(), 0
    while engine.has_unfinished():
        count += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    delta = {k: engine.counters[k] - before[k] for k in engine.counters}
    return count / elapsed, delta
