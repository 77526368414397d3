"""In-place updates of floating-point tensors, run together as one program.

A hand-written update loop writes each parameter by an eager op of its own, `for p in
model.parameters(): p.data.add_(p.grad, alpha=-lr)` (pytorch/examples' word_language_model), and
so does a model EMA (`ema.mul_(d).add_(p, alpha=1 - d)`). Each is a program call: 60-140 us of
host time on a GPU machine, where torch launches a kernel in a few. So an in-place op whose
functional program is known for its arguments (runtime/dispatch.py `_inplace_plan`'s fast path)
is recorded instead of run: its program and its arguments' current arrays (which no later write
can change: JAX arrays are immutable). The target's root holds the batch as its `_pending`
work, so that the first read or write of any target runs the batch first, as one program
composed of the recorded ones (compiled once per structure of the batch; a float that changes
between steps is that program's argument, as for a single op). Nothing is observed out of order:
a recorded op whose argument is an earlier op's target takes that op's result inside the
program, and a region's call, a device synchronize and a host read all run the batch first."""

import jax

from . import stats
from .tensor import read_value, root_of, write_value

# Ops a batch holds at most; the next one runs it first (a long loop still gets one program a
# few hundred parameters).
MAX_OPS = 512

_composed = {}  # structure -> jitted program of the whole batch


class PendingUpdates:
    """The batch being recorded: per op its program and where its arguments come from."""

    __slots__ = ("steps", "arrays", "targets", "positions", "index")

    def __init__(self, index):
        self.steps = []  # (program, floats program or None, argument sources)
        self.arrays = []  # the arrays the batch reads, in order
        self.targets = []  # the root each step writes
        self.positions = {}  # id(root) -> the step that last wrote it
        self.index = index

    def record(self, program, target, args):
        """Add `target = program(args' arrays)`; `target` is a root or a whole alias of one."""
        sources = []
        for value in args:
            if isinstance(value, (list, tuple)):
                for item in value:
                    sources.append(self._source(item))
            elif hasattr(value, "_root"):
                sources.append(self._source(value))
        floats = getattr(program, "floats", ())
        if floats:  # (a compiled_ops.WithFloats: the floats are the program's arguments)
            sources.extend(self._array(value) for value in floats)
            program = program.program
        root = root_of(target)
        self.positions[id(root)] = len(self.steps)
        self.steps.append((program, len(floats), tuple(sources)))
        self.targets.append(root)
        root._pending = self

    def _source(self, tensor):
        """Where a step's tensor argument comes from: an earlier step's result (a target read
        whole), or its array (read already by current())."""
        root = root_of(tensor)
        if root._pending is self and not tensor._chain:
            return ("step", self.positions[id(root)])
        return self._array(read_value(tensor))

    def _array(self, array):
        self.arrays.append(array)
        return ("array", len(self.arrays) - 1)

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
        if program is None:
            program = _composed[structure] = jax.jit(_compose(self.steps, writes))
            stats.deferred_programs += 1
        results = program(self.arrays)
        for position, value in zip(writes, results):
            write_value(self.targets[position], value)
        stats.deferred_ops += len(self.steps)
        stats.deferred_batches += 1


def _compose(steps, writes):
    def run(arrays):
        results = []
        for program, floats, sources in steps:
            values = [arrays[number] if kind == "array" else results[number] for kind, number in sources]
            results.append(program(values[:-floats], values[-floats:]) if floats else program(values))
        return [results[position] for position in writes]

    return run


_current = None


def current(index, args):
    """The batch that records a call with these arguments on bridge device `index`. Their
    values are read first (a read may run deferred work: a folded clip's program, this batch
    itself where an argument is a view of one of its targets), except those an earlier step of
    the batch gives whole. A new batch starts where none records or the one recording is full or
    for another device."""
    global _current
    for value in args:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(item, "_root") and (item._chain or root_of(item)._pending is not _current or _current is None):
                read_value(item)
    batch = _current
    if batch is not None and (batch.index != index or len(batch.steps) >= MAX_OPS):
        batch.resolve()
        batch = None
    if batch is None:
        batch = _current = PendingUpdates(index)
    return batch


def flush():
    """Run the batch being recorded, if any (before a region's call, a synchronize, a trace)."""
    if _current is not None:
        _current.resolve()
