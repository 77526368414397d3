"""Eager execution of a table entry as one compiled XLA call, cached per static signature.

Running an entry's `jnp` calls one by one costs a JAX dispatch each; compiling
the whole entry with `jax.jit` makes it one call. The arrays are the compiled
function's arguments; everything else (sizes, dims, Python scalars, dtypes)
is static and part of the cache key. A Python float that changes between calls
(an optimizer's step size, `x * scale` with a scale that varies) would compile
anew for each value: once two calls differ only in their floats, the floats
become arguments of one program for that signature (`lifted`), unless the entry
needs them as Python numbers (it branches on one), where that signature runs
uncompiled. An op past MAX_VARIANTS signatures runs its new ones uncompiled, and
an entry that cannot be traced (data-dependent output, a host sync) runs
uncompiled from then on.
"""

import functools
import itertools
import os

import jax

from . import dtypes, precision, stats, symbolic
from .config import settings
from .errors import MappingMismatchError

# Static signatures compiled per op before the op runs uncompiled instead.
MAX_VARIANTS = 12
# Signatures compiled per op as they come. Past them, a signature of small arrays new to the op
# runs on the host instead (runtime/dispatch.py), until it comes back after the op has met
# RECURRENCE_GAP other new ones (a loop's next round: generate's next call), or has come
# RECURRENCE_COUNT times (a shape every round has): then it compiles. An op whose shapes keep
# changing (generate's token ids and attention mask, a cache that grows by one position each
# step) would otherwise compile a program for each shape, ~20-30 ms on a CPU and more on a GPU,
# to run it once or a few times in a row. A shape that a loop meets again is worth its program:
# the host path waits for its inputs on the device, where a program call queues behind them.
EAGER_VARIANTS = 4
RECURRENCE_GAP = int(os.environ.get("BRIDGE_HOST_RECURRENCE_GAP", "2"))
RECURRENCE_COUNT = int(os.environ.get("BRIDGE_HOST_RECURRENCE_COUNT", "8"))

_ARRAY = object()
_SCALAR = object()
_SEQUENCE = object()
_LIFTED = object()  # a Python float taken as an argument of the program (CompiledEntry.lifted)

_TRACE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


def _exact(value):
    """A hashable stand-in for a Python number that tells apart what == does not: 1, 1.0 and
    True; 0.0 and -0.0 (x * -0.0 gives -0.0); and NaN, which never equals itself."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, complex):
        return (value.real.hex(), value.imag.hex())
    return value


def _from_exact(kind, exact):
    if issubclass(kind, float):
        return kind(float.fromhex(exact))
    if issubclass(kind, complex):
        return kind(complex(float.fromhex(exact[0]), float.fromhex(exact[1])))
    return exact


def _spec(value, arrays):
    """A hashable description of one argument; its arrays are appended to `arrays`."""
    if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):  # (the latter: has_compiled_many_but_not's)
        arrays.append(value)
        return _ARRAY
    if isinstance(value, (list, tuple)):
        return (_SEQUENCE, type(value), tuple(_spec(item, arrays) for item in value))
    if isinstance(value, (bool, int, float, complex)):
        return (_SCALAR, type(value), _exact(value))
    return value


def _rebuild(spec, arrays, floats=None):
    if spec is _ARRAY:
        return next(arrays)
    if spec is _LIFTED:
        return next(floats)
    if type(spec) is tuple and spec and spec[0] is _SEQUENCE:
        return spec[1](_rebuild(item, arrays, floats) for item in spec[2])
    if type(spec) is tuple and spec and spec[0] is _SCALAR:
        return _from_exact(spec[1], spec[2])
    return spec


def _call_with(call, positional_spec, keyword_spec, arrays):
    remaining = iter(arrays)
    args = [_rebuild(spec, remaining) for spec in positional_spec]
    kwargs = {name: _rebuild(spec, remaining) for name, spec in keyword_spec}
    return call(*args, **kwargs)


def _call_lifted(call, positional_spec, keyword_spec, arrays, floats):
    remaining, numbers = iter(arrays), iter(floats)
    args = [_rebuild(spec, remaining, numbers) for spec in positional_spec]
    kwargs = {name: _rebuild(spec, remaining, numbers) for name, spec in keyword_spec}
    dtypes.lifted_floats.update(id(value) for value in floats)  # they promote as Python floats
    try:
        return call(*args, **kwargs)
    finally:
        dtypes.lifted_floats.clear()


def _lift(spec, floats, first=None, baked=None):
    """`spec` with each Python float (not a subclass: numpy's float64 is typed where Python's is
    weak) replaced by _LIFTED, the float appended to `floats` as a 0-dim weakly typed float64
    array (the bridge runs JAX with x64 on), which a program computes with as it would with the
    constant: the same promotion, the same sign of zero. A float equal to its place in `first`
    (the signature's first call) stays compiled in: an entry may need it as a Python number (a
    fused optimizer kernel's betas) where only the learning rate changes from call to call.
    `baked`, unless None, gets per float None where it is lifted, else its value (WithFloats)."""
    if type(spec) is tuple and spec and spec[0] is _SCALAR and spec[1] is float:
        if baked is not None:
            baked.append(spec[2] if first == spec else None)
        if first == spec:
            return spec
        if floats is not None:
            floats.append(scalar_array(spec[2]))
        return _LIFTED
    if type(spec) is tuple and spec and spec[0] is _SEQUENCE:
        items = spec[2]
        firsts = first[2] if type(first) is tuple and first and first[0] is _SEQUENCE and len(first[2]) == len(items) else ()
        return (_SEQUENCE, spec[1], tuple(_lift(item, floats, f, baked) for item, f in itertools.zip_longest(items, firsts)))
    return spec


# float.hex() -> its 0-dim array on the device. A Python float given to a jitted function is
# copied to the device on every call (on a GPU, tens of microseconds: more than the op).
_SCALAR_ARRAYS = {}
_SCALARS_KEPT = 4096


def scalar_array(exact):
    array = _SCALAR_ARRAYS.get(exact)
    if array is None:
        if len(_SCALAR_ARRAYS) >= _SCALARS_KEPT:
            _SCALAR_ARRAYS.clear()
        array = _SCALAR_ARRAYS[exact] = jax.numpy.asarray(float.fromhex(exact))  # weakly typed
    return array


def _lifted_key(key, floats, first=None, baked=None):
    """An entry key with its Python floats lifted out (their arrays appended to `floats`, unless
    it is None), but those equal to their places in the key `first` (see _lift, and its `baked`)."""
    positional_spec, keyword_spec = key[:2]
    first_positional, first_keyword = first[:2] if first is not None else ((), ())
    return (
        tuple(_lift(spec, floats, f, baked) for spec, f in itertools.zip_longest(positional_spec, first_positional)),
        tuple(
            (name, _lift(spec, floats, f[1] if f else None, baked))
            for (name, spec), f in itertools.zip_longest(keyword_spec, first_keyword)
        ),
    ) + key[2:]


class WithFloats:
    """A lifted program with the floats of one call: called as a static variant is, with the
    call's arrays (runtime/deferred.py takes the program and its floats apart). `baked`: per
    Python float of the call, in the order of its arguments, None where the program takes it as
    an argument, else its value (float.hex()) compiled in (runtime/dispatch.py calls the program
    again with another call's floats where those match)."""

    __slots__ = ("program", "floats", "baked")

    def __init__(self, program, floats, baked=None):
        self.program, self.floats, self.baked = program, floats, baked

    def __call__(self, arrays):
        return self.program(arrays, self.floats)


def _erase_floats(spec):
    if type(spec) is tuple and spec and spec[0] is _SCALAR and issubclass(spec[1], (float, complex)):
        return (_SCALAR, spec[1], None)
    if type(spec) is tuple:
        return tuple(_erase_floats(item) for item in spec)
    return spec


def _has_float(values, keywords):
    """Whether a call's arguments hold a Python float or complex (at the top or in a list)."""
    for value in list(values) + list(keywords.values()):
        if isinstance(value, (float, complex)):
            return True
        if isinstance(value, (list, tuple)) and _has_float(value, {}):
            return True
    return False


def _returns_only_tensors(op):
    """Whether an op returns tensors and lists of tensors only (what a program can return). The
    lists count: torch's fused optimizer kernels and `_foreach_*` ops return them, and run op by
    op their mappings cost a JAX dispatch per tensor and arithmetic step (a tiny GPT-2's fused
    AdamW step in eager mode: ~350 ms on the CPU, against ~30 as one program)."""
    returns = op._schema.returns
    return bool(returns) and all(str(item.type).startswith("Tensor") or str(item.type) == "List[Tensor]" for item in returns)


# Shaped signatures remembered per op; past them an op's new shapes compile as they come.
_SHAPES_KEPT = 256


def _shaped(key, arrays):
    return key, tuple((array.shape, array.dtype) for array in arrays)


def _undeclared(op):
    """An entry read torch's precision settings and its registration does not say so (reads=):
    its programs are keyed on them from now on, as if it had. The suite makes this an error
    (BRIDGE_CHECK_FACTS=1), so that a registration's facts stay complete."""
    if settings.check_facts:
        raise MappingMismatchError(
            f"the mapping of {op} reads torch's precision settings, and its register_mapping does not declare "
            "reads=('precision',): declare it beside the entry"
        )


class CompiledEntry:
    """Runs one table entry, compiled per static signature when it can be."""

    __slots__ = ("op", "call", "variants", "lifted", "shapes", "seen", "enabled", "float_free", "reads_precision", "last")

    def __init__(self, op, call, reads_precision=False):
        self.op = op
        self.call = call
        self.variants = {}
        # Signatures whose floats changed between calls -> one program taking the floats as
        # arguments, or None where the entry cannot (it needs a float as a Python number).
        self.lifted = {}
        self.shapes = set()  # the signatures with their arrays' shapes and dtypes compiled so far
        self.seen = {}  # those run on the host -> [how many came before, calls] (has_compiled_many_but_not)
        self.float_free = {}  # the signatures compiled so far, with their floats erased: the first call's key
        self.enabled = _returns_only_tensors(op)
        # Whether the entry reads torch's matmul or convolution precision (its registration's
        # reads=): then its programs are keyed on those settings too, so that a script changing
        # them mid-run (torch.set_float32_matmul_precision) gets what it asked for.
        self.reads_precision = reads_precision
        self.last = None  # the program the last call ran (None: uncompiled), for dispatch's direct calls

    def _key(self, values, keywords, arrays):
        positional_spec = tuple(_spec(value, arrays) for value in values)
        keyword_spec = tuple((name, _spec(value, arrays)) for name, value in keywords.items())
        if self.reads_precision:
            return (positional_spec, keyword_spec, precision.precision_settings())
        return (positional_spec, keyword_spec)

    def has_compiled_many(self):
        """Whether the op compiles its calls and has compiled EAGER_VARIANTS shapes already."""
        return self.enabled and settings.compile_ops and not settings.tracing and len(self.shapes) >= EAGER_VARIANTS

    def has_compiled_many_but_not(self, values, keywords):
        """Whether this call would compile a new program (a signature or array shapes not seen
        yet: jax.jit compiles each) for an op that has compiled EAGER_VARIANTS already, and has
        not come back often enough to earn one (see RECURRENCE_GAP). The arrays may be
        jax.ShapeDtypeStructs."""
        if not self.has_compiled_many():
            return False
        arrays = []
        key = self._key(values, keywords, arrays)
        shaped = _shaped(key, arrays)
        if shaped in self.shapes or (self.lifted and _shaped(self._lifted_key(key, None), arrays) in self.shapes):
            return False
        if key not in self.variants and len(self.variants) >= MAX_VARIANTS and _erase_floats(key) not in self.float_free:
            # A signature it can no longer compile (HF's mask padded by a new amount each token):
            # on the host it is one torch call, in the mapping a JAX call per step.
            return True
        seen = self.seen.get(shaped)
        if seen is None:
            if len(self.seen) >= _SHAPES_KEPT * 16:
                self.seen.clear()
            self.seen[shaped] = [len(self.seen), 1]  # how many came before it, how often it came
            return True
        seen[1] += 1
        return len(self.seen) - seen[0] <= RECURRENCE_GAP and seen[1] < RECURRENCE_COUNT

    def __call__(self, values, keywords):
        self.last = None  # the program this call runs (stays None where it runs uncompiled)
        if not (self.enabled and settings.compile_ops) or settings.tracing:
            if not self.enabled and settings.compile_ops and not settings.tracing and self.op in stats.uncompiled_reasons:
                return self._uncompiled(values, keywords)  # (an op that stopped compiling)
            if symbolic.current is not None:  # torch's SymInts as jax.export's dimension expressions
                values, keywords = symbolic.jax_arguments(values, keywords)
            return self.call(*values, **keywords)
        arrays = []
        key = self._key(values, keywords, arrays)
        compiled = self.variants.get(key)
        if compiled is not None:
            try:
                out = compiled(arrays)
                if len(self.shapes) < _SHAPES_KEPT:
                    self.shapes.add(_shaped(key, arrays))
                self.last = compiled
                return out
            except _TRACE_ERRORS:
                # New array dtypes/shapes retraced into a data-dependent path (a bool mask
                # where an integer index was compiled): run this op uncompiled from now on.
                self.enabled = False
                return self._uncompiled(values, keywords, "its trace needs data-dependent values")
        # (a key with no float is its own float-free form: most are, and erasing walks it all)
        float_free = _erase_floats(key) if _has_float(values, keywords) else key
        if float_free in self.float_free:
            return self._lifted_call(key, values, keywords, arrays)
        if len(self.variants) >= MAX_VARIANTS:
            return self._uncompiled(values, keywords, f"more than {MAX_VARIANTS} signatures (scalars, sizes, dtypes)")
        self.float_free[float_free] = key
        positional_spec, keyword_spec = key[:2]
        compiled = jax.jit(functools.partial(_call_with, self.call, positional_spec, keyword_spec))
        reads = precision.reads
        try:
            out = compiled(arrays)
        except _TRACE_ERRORS:
            self.enabled = False
            return self._uncompiled(values, keywords, "its trace needs data-dependent values")
        if precision.reads != reads and not self.reads_precision:
            # A registration that does not declare what its entry reads (see _undeclared):
            # the programs compiled so far were keyed without the settings.
            _undeclared(self.op)
            self.reads_precision = True
            self.variants.clear()
            key = key + (precision.precision_settings(),)
            self.float_free = {_erase_floats(key): key}
        self.variants[key] = compiled
        self.shapes.add(_shaped(key, arrays))
        self.last = compiled
        return out

    def _lifted_call(self, key, values, keywords, arrays):
        """A call whose floats differ from an earlier call's with the same signature: the
        signature's program taking the floats as arguments, compiled on the first such call."""
        floats = []
        baked = []
        lifted_key = self._lifted_key(key, floats, baked)
        program = self.lifted.get(lifted_key, _ARRAY)
        if program is None:
            return self._uncompiled(values, keywords, "it needs a changing float as a Python number")
        if program is _ARRAY and len(self.lifted) >= MAX_VARIANTS:
            return self._uncompiled(values, keywords, f"more than {MAX_VARIANTS} signatures (scalars, sizes, dtypes)")
        compiling = program is _ARRAY
        if compiling:
            program = jax.jit(functools.partial(_call_lifted, self.call, *lifted_key[:2]))
        reads = precision.reads
        try:
            out = program(arrays, floats)
        except Exception:  # noqa: BLE001 - the uncompiled call below raises the call's own error
            # The entry needs a float as a Python number (it branches on it, converts it, indexes
            # it), or new shapes retraced into a data-dependent path: this signature runs
            # uncompiled, as with the float compiled in (a bad call raises there, as torch does).
            self.lifted[lifted_key] = None
            return self._uncompiled(values, keywords, "it needs a changing float as a Python number")
        if compiling and precision.reads != reads and not self.reads_precision:
            # As in __call__: programs keyed without the precision settings are dropped.
            _undeclared(self.op)
            self.reads_precision = True
            self.variants.clear()
            self.lifted.clear()
            self.float_free = {}
            return out
        self.lifted[lifted_key] = program
        self.last = WithFloats(program, floats, tuple(baked))
        if len(self.shapes) < _SHAPES_KEPT:
            self.shapes.add(_shaped(lifted_key, arrays))
        return out

    def _lifted_key(self, key, floats, baked=None):
        """The key's floats lifted out, but those its signature's first call had too."""
        return _lifted_key(key, floats, self.float_free.get(_erase_floats(key)), baked)

    def _uncompiled(self, values, keywords, reason=None):
        """The entry's jnp calls one by one (a JAX dispatch each), counted for the run report."""
        stats.uncompiled_calls[self.op] += 1
        if reason is not None:
            stats.uncompiled_reasons.setdefault(self.op, reason)
        return self.call(*values, **keywords)
