"""PyTorch's ModuleInfo database through the bridge (quick mode: the first input of every module,
dtype and mode): forward and backward, train and eval, must pass or be listed expected failures."""

import pytest

from bridge.compat import harness, moduleinfo

MODULES = moduleinfo.entry_names()


@pytest.fixture(scope="module")
def sweep():
    return harness.run_sweep_parallel("bridge.compat.moduleinfo", MODULES, workers=2, quick=True)


def test_every_module_ran(sweep):
    missing = [name for name in MODULES if name not in sweep["ops"] and name not in sweep["crashed"]]
    assert not missing, f"the sweep did not reach {len(missing)} modules: {missing[:20]}"


@pytest.mark.parametrize("module", MODULES)
def test_module(sweep, module):
    records = [record for record in sweep["records"] if record["entry"].rsplit(".", 1)[0] == module]
    found = harness.problems(records)
    assert not found, "\n".join(found)


def test_listed_failures_name_real_modules():
    from bridge.compat import expected_failures

    known = set(MODULES) | {f"{name}.{mode}" for name in MODULES for mode in ("train", "eval")}
    unknown = sorted(set(expected_failures.MODULEINFO) - known)
    assert not unknown, f"compat/expected_failures.py lists modules ModuleInfo does not have: {unknown}"
