"""`python -m bridge compare`: the same numbers from plain torch and from the bridge."""

import os

from bridge.compare import compare_outputs
from conftest import REPO, run_python


def test_compare_outputs_finds_the_worst_difference():
    worst, problems = compare_outputs("loss 1.0\nloss 2.0\n", "loss 1.0\nloss 2.00001\n", rtol=1e-4, atol=0)
    assert abs(worst - 5e-6) < 1e-9 and problems == []
    worst, problems = compare_outputs("loss 1.0\n", "loss 1.1\n", rtol=1e-5, atol=0)
    assert len(problems) == 1 and "1.1" in problems[0]
    _, problems = compare_outputs("a 1\nb 2\n", "a 1\n", rtol=1e-5, atol=0)
    assert problems and "2 lines" in problems[0]


def test_compare_command_on_the_cnn_example():
    result = run_python(
        "-m", "bridge", "compare", "--match", "loss", os.path.join(REPO, "examples", "cnn.py"), "--steps", "5"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 lines compared" in result.stdout
