"""README.md's benchmark tables match the results files they cite (benchmarks/tables.py)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_readme_tables_are_rebuilt_from_the_results_files():
    # A process of its own: the script puts benchmarks/ on sys.path, whose module names
    # (run, models, machine) must not shadow anything in the test session.
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tables.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
