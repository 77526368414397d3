"""PyTorch's OpInfo database through the bridge (quick mode: the first sample of every entry and
dtype): every result must be a pass, a skip of the database's own, or a listed expected failure."""

import pytest

from bridge.compat import harness, opinfo

ENTRIES = opinfo.entry_names()


@pytest.fixture(scope="module")
def sweep():
    # In child processes: a crash or a hang costs one entry, and the bridge stays off here.
    return harness.run_sweep_parallel("bridge.compat.opinfo", ENTRIES, workers=2, quick=True)


def test_every_entry_ran(sweep):
    missing = [name for name in ENTRIES if name not in sweep["ops"] and name not in sweep["crashed"]]
    assert not missing, f"the sweep did not reach {len(missing)} entries: {missing[:20]}"


@pytest.mark.parametrize("entry", ENTRIES)
def test_entry(sweep, entry):
    records = [record for record in sweep["records"] if record["entry"] == entry]
    found = harness.problems(records)
    assert not found, "\n".join(found)


def test_listed_failures_name_real_entries():
    from bridge.compat import expected_failures

    unknown = sorted(set(expected_failures.OPINFO) - set(ENTRIES))
    assert not unknown, f"compat/expected_failures.py lists entries OpInfo does not have: {unknown}"
