"""`python -m bridge run`: the script runs as `python SCRIPT ARGS` would."""

import json
import os
import sys

from conftest import REPO, run_python


def _script(tmp_path, text, name="script.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_argv_main_and_file(tmp_path):
    script = _script(
        tmp_path,
        "import sys, os\n"
        "print('argv', sys.argv)\n"
        "print('name', __name__)\n"
        "print('file', os.path.basename(__file__))\n"
        "print('path0', sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n",
    )
    result = run_python("-m", "bridge", "run", "--quiet", script, "--lr", "3e-4", "positional")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"argv {[script, '--lr', '3e-4', 'positional']}"
    assert lines[1] == "name __main__"
    assert lines[2] == "file script.py"
    assert lines[3] == "path0 True"


def test_sys_exit_code_passes_through(tmp_path):
    script = _script(tmp_path, "import sys\nsys.exit(3)\n")
    assert run_python("-m", "bridge", "run", "--quiet", script).returncode == 3


def test_exception_gives_traceback_naming_user_file(tmp_path):
    script = _script(tmp_path, "def broken():\n    raise ValueError('boom')\n\nbroken()\n", name="user_script.py")
    result = run_python("-m", "bridge", "run", "--quiet", script)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "user_script.py\", line 2, in broken" in result.stderr
    assert "ValueError: boom" in result.stderr
    assert "runpy" not in result.stderr  # the runner's own frames are not shown


def test_script_sees_its_own_directory_for_imports(tmp_path):
    (tmp_path / "helper_module.py").write_text("VALUE = 42\n")
    script = _script(tmp_path, "import helper_module\nprint(helper_module.VALUE)\n")
    result = run_python("-m", "bridge", "run", "--quiet", script, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "42"


def test_summary_and_json_report(tmp_path):
    script = _script(
        tmp_path,
        "import torch\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "x = torch.ones(4, device=device)\n"
        "print((x * 3).sum().item())\n",
    )
    report = tmp_path / "out.json"
    result = run_python("-m", "bridge", "run", "--report", str(report), script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "12.0"
    assert "bridge:" in result.stderr and "torch ops ran" in result.stderr
    data = json.loads(report.read_text())
    assert data["ops_run"] >= 2
    assert set(data["by_rung"]) == {"mapped", "mapped (in-place/out= derived)", "decomposed", "cpu_fallback"}
    assert any(op["op"] == "aten.mul.Tensor" for op in data["ops"])


def test_help_explains_options():
    result = run_python("-m", "bridge", "run", "--help")
    assert result.returncode == 0
    for option in ("--report", "--strict", "--quiet", "--device"):
        assert option in result.stdout


def test_missing_script_is_a_clear_error(tmp_path):
    result = run_python("-m", "bridge", "run", str(tmp_path / "nope.py"))
    assert result.returncode == 2
    assert "nope.py" in result.stderr


def test_html_report_names_fallbacks_and_draws_charts(tmp_path):
    script = _script(
        tmp_path,
        "import torch\n"
        "@torch.library.custom_op('reporttest::unmapped', mutates_args=())\n"
        "def unmapped(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x + 1\n"
        "x = torch.ones(4, device='cuda')\n"
        "print((x * 3).sum().item())\n"
        "print(unmapped(x).cpu().tolist())\n",
        name="reporting.py",
    )
    report = tmp_path / "run.html"
    result = run_python("-m", "bridge", "run", "--quiet", "--report", str(report), script)
    assert result.returncode == 0, result.stderr
    page = report.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "http" not in page.split("<body>")[0]
    assert "aten.mul.Tensor" in page and "Ops by rung of the fallback ladder" in page
    assert "reporttest.unmapped.default" in page and "reporting.py:7" in page  # the fallback and its call site
