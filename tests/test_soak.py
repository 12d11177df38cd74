"""The soak script's short run (the long one is scripts/soak_serving.py's default)."""

import subprocess
import sys

import pytest

from serving_support import REPO_ROOT, repo_env


@pytest.mark.slow
def test_a_short_soak_serves_everything():
    cmd = [sys.executable, "scripts/soak_serving.py", "--duration-s", "12", "--window-s", "6", "--clients", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert " 0 errors, 0 sequence gaps" in out.stdout and "server exit code 0" in out.stdout
    served = int(out.stdout.rsplit("\n\n", 1)[1].split()[0])
    assert served > 0, out.stdout
