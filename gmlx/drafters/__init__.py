"""Drafters behind one protocol: an MTP head, a separate draft model, and n-gram lookup."""

from __future__ import annotations

from gmlx.config import BUILTIN_DRAFT_DIR, BUILTIN_MTP_DIR, BUILTIN_TARGET_DIR

DRAFTER_KINDS = ("none", "mtp", "draft", "ngram")


def parse_drafter(spec: str | None) -> tuple[str, str | None]:
    """'draft:/path' -> ('draft', '/path'); ValueError naming the drafter for unknown kinds."""
    spec = (spec or "none").strip()
    kind, _, path = spec.partition(":")
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter {spec!r}: expected one of none, mtp, draft[:PATH], ngram")
    if path and kind not in ("draft", "mtp"):
        raise ValueError(f"drafter {spec!r}: only draft and mtp take a path")
    return kind, (path or None)


def make_drafter(spec: str | None, target, num_draft_tokens: int | None = None):
    """Build the drafter for `target` (a LoadedModel), or None for plain decoding."""
    kind, path = parse_drafter(spec)
    if kind == "none":
        return None
    is_builtin_target = target.path == str(BUILTIN_TARGET_DIR)
    if kind == "ngram":
        from gmlx.drafters.ngram import NgramDrafter

        return NgramDrafter(num_draft_tokens=num_draft_tokens)
    if kind == "mtp" and path is None and not is_builtin_target:
        from gmlx.models.head_registry import find_shipped_head

        path = find_shipped_head(target.path)  # a head shipped for this exact GGUF file
        if path is None:
            raise ValueError(f"drafter 'mtp': no MTP head ships for {target.path}; give one (mtp:PATH), "
                             f"e.g. made by scripts/train_mtp_head.py")
    if path is None and not is_builtin_target:
        raise ValueError(f"drafter {kind!r}: give a path ({kind}:PATH); built-in weights fit only the built-in model")
    if kind == "mtp":
        from gmlx.drafters.mtp import MTPDrafter

        return MTPDrafter(path or BUILTIN_MTP_DIR, target, num_draft_tokens=num_draft_tokens)
    from gmlx.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(path or BUILTIN_DRAFT_DIR, target, num_draft_tokens=num_draft_tokens)
