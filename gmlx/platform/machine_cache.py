"""Measurements of this machine cached as JSON under gmlx.config.cache_dir(): one file per
kind (BLAS core timings, speculation costs), one entry per key, the key a hash of what the
measurement depends on (CPU, builds, weights). This module must not import mlx."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from gmlx import config

logger = logging.getLogger(__name__)


def cache_key(parts: list[str], files: list[Path]) -> str:
    """A short hash of `parts` and each file's size and modification time (missing: so marked)."""
    words = list(parts)
    for path in files:
        try:
            stat = Path(path).resolve().stat()
            words.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            words.append(f"{path}:missing")
    return hashlib.sha256("\n".join(words).encode()).hexdigest()[:24]


def cache_path(name: str) -> Path:
    return config.cache_dir() / f"{name}.json"


def _entries(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def read_entry(name: str, key: str) -> dict | None:
    entry = _entries(cache_path(name)).get(key)
    return entry if isinstance(entry, dict) else None


def write_entry(name: str, key: str, entry: dict) -> None:
    """Add or replace one entry; a cache that cannot be written is logged, never raised."""
    path = cache_path(name)
    entries = _entries(path)
    entries[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)  # atomic: concurrent starts never read half a file
    except OSError as exc:
        logger.info("could not cache %s at %s: %s", name, path, exc)
