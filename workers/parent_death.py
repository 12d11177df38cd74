"""Children that end with their parent: a `preexec_fn` for the processes gmlx starts."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the thread that started it dies (Linux;
    elsewhere a parent's own shutdown stops it), so a killed parent leaves no server behind."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
