"""Offline training text for the scripts: Python stdlib sources (code) and this machine's
man pages, license texts and package READMEs (prose), split train / held-out by whole file.

A file is held out when a hash of its path says so, never by its index, so adding or
removing one file elsewhere does not reshuffle the split. The stdlib rule is the one the
built-in model was trained with (train_builtin.py) and bench_models.heldout_prompts uses.
"""

from __future__ import annotations

import gzip
import re
import sysconfig
import zlib
from pathlib import Path

# pydoc_data/topics.py (~750 KB) is English documentation wrapped in a dict literal,
# not Python code; anything that large is data rather than source.
MAX_SOURCE_FILE_BYTES = 512 * 1024
HELDOUT_PER_MILLE = 30
MAN_SECTIONS = ("man1", "man5", "man7", "man8")  # commands, formats, overviews, admin: prose
LICENSES_DIR = Path("/usr/share/common-licenses")
DOC_DIR = Path("/usr/share/doc")
MAN_DIR = Path("/usr/share/man")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, heldout_per_mille: int = HELDOUT_PER_MILLE) -> bool:
    return zlib.crc32(rel_path.encode()) % 1000 < heldout_per_mille


def list_code_files(root: Path | None = None) -> list[Path]:
    """All stdlib .py sources in sorted relative-path order (deterministic)."""
    root = root or stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel_parts = path.relative_to(root).parts
        if "site-packages" in rel_parts or "__pycache__" in rel_parts:
            continue
        # Generated at build time from this machine's compiler flags: not source code,
        # and it would make the corpus differ from one Python build to the next.
        if path.name.startswith("_sysconfigdata"):
            continue
        if not path.is_file() or path.stat().st_size > MAX_SOURCE_FILE_BYTES:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_code_files(heldout_per_mille: int = HELDOUT_PER_MILLE) -> tuple[list[Path], list[Path]]:
    root = stdlib_dir()
    train, heldout = [], []
    for path in list_code_files(root):
        (heldout if is_heldout(path.relative_to(root).as_posix(), heldout_per_mille) else train).append(path)
    return train, heldout


def list_prose_files() -> list[Path]:
    """English man pages, license texts and package READMEs, deduplicated by resolved path."""
    found = set()
    for section in MAN_SECTIONS:
        # gcloud's ~16k generated pages are one template: they would drown every other voice.
        found.update(p for p in (MAN_DIR / section).glob("*.gz") if p.is_file() and not p.name.startswith("gcloud"))
    if LICENSES_DIR.is_dir():
        found.update(p for p in LICENSES_DIR.iterdir() if p.is_file())
    if DOC_DIR.is_dir():
        found.update(p for p in DOC_DIR.glob("*/README*") if p.is_file())
        found.update(p for p in DOC_DIR.glob("*/copyright") if p.is_file())
    return sorted({p.resolve() for p in found})


def split_prose_files(heldout_per_mille: int = HELDOUT_PER_MILLE) -> tuple[list[Path], list[Path]]:
    train, heldout = [], []
    for path in list_prose_files():
        (heldout if is_heldout(path.as_posix(), heldout_per_mille) else train).append(path)
    return train, heldout


_ROFF_FONT = re.compile(r"\\f(\(..|\[[^\]]*\]|.)")
_ROFF_SPECIAL = {r"\(em": "--", r"\(en": "-", r"\(aq": "'", r"\(dq": '"', r"\(lq": '"', r"\(rq": '"',
                 r"\(bu": "*", r"\(co": "(c)", r"\-": "-", r"\&": "", r"\e": "\\", r"\ ": " ", r"\|": "", r"\^": ""}
_ROFF_OTHER = re.compile(r"\\(\(..|\*\(..|\*.|\[[^\]]*\]|s[-+]?\d|[a-zA-Z])")
_TEXT_MACROS = {".SH", ".SS", ".B", ".I", ".BR", ".BI", ".IB", ".IR", ".RB", ".RI", ".SM", ".TP", ".IP", ".Nm",
                ".Nd", ".Sh", ".Ss", ".Pp", ".It", ".Fl", ".Ar", ".Op", ".Xr", ".Dq", ".Em"}


def roff_to_text(source: str) -> str:
    """The words of a man page with its markup dropped (good enough to train on, not to read)."""
    lines = []
    for line in source.splitlines():
        if line.startswith((".\\\"", "'\\\"", '.\\"')):
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line.partition(" ")
            if macro not in _TEXT_MACROS or not rest.strip():
                continue
            line = rest.replace('"', "")
        for code, text in _ROFF_SPECIAL.items():
            line = line.replace(code, text)
        line = _ROFF_OTHER.sub("", _ROFF_FONT.sub("", line))
        lines.append(line)
    return "\n".join(lines)


def read_text(path: Path) -> str | None:
    """A file's text (gunzipped, man markup dropped), or None when it is not UTF-8."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None  # a few fixtures are deliberately latin-1 or broken: not worth learning
    if path.is_relative_to(MAN_DIR):
        text = roff_to_text(text)
    return re.sub(r"\n{3,}", "\n\n", text)
