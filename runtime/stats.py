"""Counters for the run report: ops by rung of the fallback ladder, and fallbacks by name."""

import collections
import time

MAPPED = "mapped"
DERIVED = "mapped (in-place/out= derived)"
DECOMPOSED = "decomposed"
CPU_FALLBACK = "cpu_fallback"
RUNGS = (MAPPED, DERIVED, DECOMPOSED, CPU_FALLBACK)


class Tally:
    """An op's calls and host seconds since reset()."""

    __slots__ = ("calls", "seconds")

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0


# OpOverload -> its Tally, made once: runtime/dispatch.py keeps each and adds to it without
# hashing the op again (OpOverload's hash is Python code, and dispatch runs for every op).
tallies = {}


def tally(op):
    found = tallies.get(op)
    if found is None:
        found = tallies[op] = Tally()
    return found


def op_counts():
    """OpOverload -> calls since reset(), for the ops called."""
    return collections.Counter({op: found.calls for op, found in tallies.items() if found.calls})


def calls(op):
    found = tallies.get(op)
    return 0 if found is None else found.calls


op_rung = {}  # OpOverload -> rung name
op_family = {}  # OpOverload -> mapping family (module of op_mappings), None if not mapped
fallback_sites = {}  # OpOverload -> first user call site
fallback_calls = collections.Counter()  # OpOverload -> runs on the host CPU (also as part of a derived op)
host_runs = collections.Counter()  # OpOverload -> calls run on the host by torch's CPU kernel (dispatch._on_host)
# OpOverload -> calls run uncompiled, their jnp calls one by one (runtime/compiled_ops.py), and
# why (the reasons stay across reset(), as op_rung does: they describe the cached plans)
uncompiled_calls = collections.Counter()
uncompiled_reasons = {}
dtype_corrections = {}  # OpOverload -> message
# In-place updates run as batches (runtime/deferred.py): ops recorded, batches run, programs compiled
deferred_ops = deferred_batches = deferred_programs = 0
# DistributedDataParallel's gradient averages: run inside the optimizer's step, or alone
ddp_averages = collections.Counter()
# HF generate calls given a static cache in place of their default dynamic one, by model class
hf_static_caches = collections.Counter()
started = [time.perf_counter()]


def reset():
    for found in tallies.values():  # (op_rung and op_family stay: they describe cached plans)
        found.calls, found.seconds = 0, 0.0
    fallback_sites.clear()
    fallback_calls.clear()
    host_runs.clear()
    global deferred_ops, deferred_batches, deferred_programs
    deferred_ops = deferred_batches = deferred_programs = 0
    ddp_averages.clear()
    hf_static_caches.clear()
    uncompiled_calls.clear()
    dtype_corrections.clear()
    started[0] = time.perf_counter()


def summary():
    """A plain-data summary (what the JSON report holds)."""
    by_rung = collections.Counter()
    rung_seconds = collections.Counter()
    family_seconds = collections.Counter()
    ops = []
    counts = op_counts()
    for op, count in counts.most_common():
        rung = op_rung.get(op, MAPPED)
        seconds = tallies[op].seconds
        by_rung[rung] += count
        rung_seconds[rung] += seconds
        family = op_family.get(op) or rung
        family_seconds[family] += seconds
        ops.append({"op": str(op), "calls": count, "rung": rung, "family": family, "host_seconds": round(seconds, 6)})
    return {
        "ops_run": sum(counts.values()),
        "distinct_ops": len(counts),
        "by_rung": {rung: by_rung.get(rung, 0) for rung in RUNGS},
        "host_seconds_by_rung": {rung: round(rung_seconds.get(rung, 0.0), 6) for rung in RUNGS},
        "cpu_fallbacks": [
            {"op": str(op), "calls": fallback_calls[op], "first_call_site": site} for op, site in fallback_sites.items()
        ],
        "host_runs": {str(op): count for op, count in host_runs.most_common()},
        "deferred_updates": {"ops": deferred_ops, "batches": deferred_batches, "programs": deferred_programs},
        "ddp_gradient_averages": {"in_step": ddp_averages["in_step"], "alone": ddp_averages["alone"]},
        "hf_static_caches": dict(hf_static_caches),
        "uncompiled": [
            {"op": str(op), "calls": count, "why": uncompiled_reasons.get(op, "")} for op, count in uncompiled_calls.most_common()
        ],
        "dtype_corrections": [{"op": str(op), "detail": detail} for op, detail in dtype_corrections.items()],
        "host_seconds_by_family": {family: round(seconds, 6) for family, seconds in family_seconds.most_common()},
        "ops": ops,
        "wall_seconds": time.perf_counter() - started[0],
    }
