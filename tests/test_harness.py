"""The test harness itself: a test past its hard timeout stops the run visibly."""

import os
import subprocess
import sys
import time
from pathlib import Path

from serving_support import REPO_ROOT, repo_env

HUNG_TEST = """
import time
TEST_TIMEOUT_S = 2

def test_hangs():
    time.sleep(120)
"""


def test_a_hung_test_is_named_with_its_tracebacks_and_stops_the_run(tmp_path):
    """Past TEST_TIMEOUT_S the run ends with the test's name, every thread's traceback and
    pytest's own summary (a KeyboardInterrupt, exit 2), not a silent exit under the capture."""
    (tmp_path / "test_hung.py").write_text(HUNG_TEST)
    env = repo_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])  # conftest as a plugin
    start_s = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_hung.py")],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=100)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "test_hung.py::test_hangs: past its hard timeout of 2 s" in text, text
    assert "in test_hangs" in text and "KeyboardInterrupt" in text, text
    assert time.monotonic() - start_s < 60
