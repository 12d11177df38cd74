"""MTP heads shipped for specific model files, found and checked by the file's sha256.

A head distilled from one GGUF has learned that file's hidden states; on any other file
(another quantization, another fine-tune) its drafts are guesses, so the drafter refuses it.
No mlx here: only paths, hashes and each head's config.json.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

from gmlx.models.source import is_gguf_path

logger = logging.getLogger(__name__)

SHIPPED_HEADS_DIR = Path(__file__).resolve().parent / "heads"
HASH_CHUNK_BYTES = 1 << 20


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file; cached per (path, size, mtime) so a model is hashed once a process."""
    path = Path(path).resolve()
    stat = path.stat()
    return _sha256_cached(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256_cached(path: str, size_bytes: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def target_sha256(target_path: str | Path) -> str | None:
    """The checksum heads are tied to: a GGUF file's sha256; None for a model folder."""
    return file_sha256(target_path) if is_gguf_path(target_path) and Path(target_path).is_file() else None


def read_head_identity(head_dir: Path) -> tuple[str | None, str | None]:
    """(target_sha256, target_name) from a head folder's config.json; (None, None) when absent."""
    try:
        config = json.loads((Path(head_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None, None
    if not isinstance(config, dict):
        return None, None
    return config.get("target_sha256"), config.get("target_name")


def find_shipped_head(target_path: str | Path, heads_dir: Path = SHIPPED_HEADS_DIR) -> Path | None:
    """The shipped head folder whose target_sha256 is this model file's, or None."""
    checksum = target_sha256(target_path)
    if checksum is None or not heads_dir.is_dir():
        return None
    for head_dir in sorted(p for p in heads_dir.iterdir() if p.is_dir()):
        if read_head_identity(head_dir)[0] == checksum:
            return head_dir
    return None


def check_head_fits_target(head_dir: str | Path, head_sha256: str | None, head_target_name: str | None,
                           target_path: str | Path) -> None:
    """ValueError when a head tied to one model file is given another; untied heads pass."""
    if head_sha256 is None:
        return
    checksum = target_sha256(target_path)
    if checksum != head_sha256:
        found = f"sha256 {checksum}" if checksum else "a model folder, not a GGUF file"
        raise ValueError(
            f"drafter mtp:{head_dir}: this MTP head was distilled from {head_target_name or 'another model'} "
            f"(sha256 {head_sha256}), but the target {target_path} is {found}; "
            f"train a head for it with scripts/train_mtp_head.py")
