"""The hand-written `_core.pyi` stub stays true to the compiled module."""

import subprocess
import sys


def test_stubtest_agrees_with_the_extension():
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "aieng._core", "--ignore-missing-stub"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
