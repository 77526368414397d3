"""In-place updates of floating-point tensors, run together as one program.

A hand-written update loop writes each parameter by an eager op of its own, `for p in
model.parameters(): p.data.add_(p.grad, alpha=-lr)` (pytorch/examples' word_language_model), and
so does a model EMA (`ema.mul_(d).add_(p, alpha=1 - d)`). Each is a program call: 60-140 us of
host time on a GPU machine, where torch launches a kernel in a few. So an in-place op whose
functional program is known for its arguments (runtime/dispatch.py `_inplace_plan`'s fast path)
is recorded instead of run: its program and its arguments' current arrays (which no later write
can change: JAX arrays are immutable). The target's root holds the batch as its `_pending`
work, so that the first read or write of any target runs the batch first, as one program
composed of the recorded ones (compiled for a structure of batch met a second time, the first
running its ops' programs one by one; a float that changes between steps is that program's
argument, as for a single op). Nothing is observed out of order:
a recorded op whose argument is an earlier op's target takes that op's result inside the
program, and a region's call, a device synchronize and a host read all run the batch first."""

import jax

from . import stats
from .tensor import read_value, root_of, write_value

# Ops a batch holds at most; the next one runs it first (a long loop still gets one program a
# few hundred parameters).
MAX_OPS = 512

_composed = {}  # structure -> jitted program of the whole batch
_seen = set()  # structures met once
_KEPT = 64  # composed programs kept (past it, all are dropped and compiled again as they come)


class PendingUpdates:
    """The batch being recorded: per op its program and where its arguments come from."""

    __slots__ = ("steps", "arrays", "targets", "positions", "index")

    def __init__(self, index):
        self.steps = []  # (program, how many floats it takes last, argument sources: -1 - k for
        # arrays[k], n >= 0 for step n's result)
        self.arrays = []  # the arrays the batch reads, in order
        self.targets = []  # the root each step writes
        self.positions = {}  # id(root) -> the step that last wrote it
        self.index = index

    def resolve(self, tensor=None):
        """Run the batch: one program, its results written into the targets."""
        global _current
        if _current is self:
            _current = None
        if not self.steps:
            return
        last = {}
        for position, root in enumerate(self.targets):
            last[id(root)] = position
            root._pending = None
        writes = tuple(sorted(last.values()))
        structure = (tuple(self.steps), writes)
        program = _composed.get(structure)
        if program is None and structure in _seen:
            if len(_composed) >= _KEPT:
                _composed.clear()
            program = _composed[structure] = jax.jit(_compose(self.steps, writes))
            stats.deferred_programs += 1
        elif program is None:
            # The first batch of its structure runs its ops' programs one by one, as they would
            # have run unrecorded: a loop whose batches never repeat compiles nothing more.
            if len(_seen) >= _KEPT * 4:
                _seen.clear()
            _seen.add(structure)
            program = _compose(self.steps, writes)
        results = program(self.arrays)
        for position, value in zip(writes, results):
            write_value(self.targets[position], value)
        stats.deferred_ops += len(self.steps)
        stats.deferred_batches += 1


def _compose(steps, writes):
    def run(arrays):
        results = []
        for program, floats, sources in steps:
            values = [arrays[-number - 1] if number < 0 else results[number] for number in sources]
            results.append(program(values[:-floats], values[-floats:]) if floats else program(values))
        return [results[position] for position in writes]

    return run


_current = None


def record(program, target, tensors):
    """Record `target = program(the arrays of tensors)` (runtime/dispatch.py `_inplace_plan`'s
    direct call, `tensors` in the order the program takes their arrays); `target` is a root or a
    whole alias of one."""
    global _current
    index = target._index
    while True:
        batch = _current
        if batch is not None and (batch.index != index or len(batch.steps) >= MAX_OPS):
            batch.resolve()
            batch = None
        sources = []
        for tensor in tensors:
            root = root_of(tensor)
            if batch is not None and root._pending is batch and not tensor._chain:
                sources.append(batch.positions[id(root)])  # an earlier step's result
            else:
                sources.append(read_value(tensor))  # (which may run deferred work, this batch too)
        if _current is batch:
            break
        # A read ran the batch (an argument viewing one of its targets; a folded clip, whose
        # program is a region's, which runs pending updates first): again, with none recording.
    if batch is None:
        batch = _current = PendingUpdates(index)
    arrays = batch.arrays
    for position, source in enumerate(sources):
        if type(source) is not int:
            arrays.append(source)
            sources[position] = -len(arrays)  # (arrays as negative numbers, steps as others)
    floats = getattr(program, "floats", ())
    if floats:  # (a compiled_ops.WithFloats: the floats are the program's arguments)
        for value in floats:
            arrays.append(value)
            sources.append(-len(arrays))
        program = program.program
    root = root_of(target)
    batch.positions[id(root)] = len(batch.steps)
    batch.steps.append((program, len(floats), tuple(sources)))
    batch.targets.append(root)
    root._pending = batch
    # Written now, as far as anything that compares generations knows (a host copy of the value,
    # the implicit gradient's "still ones", a view's cached value); the value follows when read.
    root._generation += 1


def flush():
    """Run the batch being recorded, if any (before a region's call, a synchronize, a trace)."""
    if _current is not None:
        _current.resolve()
