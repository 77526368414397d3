"""Eager execution of a table entry as one compiled XLA call, cached per static signature.

Running an entry's `jnp` calls one by one costs a JAX dispatch each; compiling
the whole entry with `jax.jit` makes it one call. The arrays are the compiled
function's arguments; everything else (sizes, dims, Python scalars, dtypes)
is static and part of the cache key. An op called with a Python float that
keeps changing (an optimizer's step size) would compile anew for each value:
once two calls differ only in such floats, the op runs uncompiled from then
on; so does an op past MAX_VARIANTS signatures, and an entry that cannot be
traced (data-dependent output, a host sync).
"""

import functools

import jax

from .config import settings

# Static signatures compiled per op before the op runs uncompiled instead.
MAX_VARIANTS = 12

_ARRAY = object()

_TRACE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


def _spec(value, arrays):
    """A hashable description of one argument; its arrays are appended to `arrays`."""
    if isinstance(value, jax.Array):
        arrays.append(value)
        return _ARRAY
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_spec(item, arrays) for item in value))
    if isinstance(value, (bool, int, float, complex)):
        # 1, 1.0 and True hash alike but promote differently; NaN never equals itself.
        return (type(value), value if value == value else "nan")
    return value


def _rebuild(spec, arrays):
    if spec is _ARRAY:
        return next(arrays)
    if type(spec) is tuple and len(spec) == 2 and spec[0] in (list, tuple):
        return spec[0](_rebuild(item, arrays) for item in spec[1])
    if type(spec) is tuple and len(spec) == 2 and spec[0] in (bool, int, float, complex):
        return float("nan") if spec[1] == "nan" else spec[1]
    return spec


def _call_with(call, positional_spec, keyword_spec, arrays):
    remaining = iter(arrays)
    args = [_rebuild(spec, remaining) for spec in positional_spec]
    kwargs = {name: _rebuild(spec, remaining) for name, spec in keyword_spec}
    return call(*args, **kwargs)


def _erase_floats(spec):
    if type(spec) is tuple and len(spec) == 2 and spec[0] is float:
        return (float, None)
    if type(spec) is tuple:
        return tuple(_erase_floats(item) for item in spec)
    return spec


def _returns_only_tensors(op):
    returns = op._schema.returns
    return bool(returns) and all(str(item.type).startswith("Tensor") for item in returns)


class CompiledEntry:
    """Runs one table entry, compiled per static signature when it can be."""

    __slots__ = ("call", "variants", "enabled", "float_free")

    def __init__(self, op, call):
        self.call = call
        self.variants = {}
        self.float_free = set()  # the signatures compiled so far, with their floats erased
        self.enabled = _returns_only_tensors(op)

    def __call__(self, values, keywords):
        if not (self.enabled and settings.compile_ops) or settings.tracing:
            return self.call(*values, **keywords)
        arrays = []
        positional_spec = tuple(_spec(value, arrays) for value in values)
        keyword_spec = tuple((name, _spec(value, arrays)) for name, value in keywords.items())
        key = (positional_spec, keyword_spec)
        compiled = self.variants.get(key)
        if compiled is not None:
            try:
                return compiled(arrays)
            except _TRACE_ERRORS:
                # New array dtypes/shapes retraced into a data-dependent path (a bool mask
                # where an integer index was compiled): run this op uncompiled from now on.
                self.enabled = False
                return self.call(*values, **keywords)
        float_free = _erase_floats(key)
        if len(self.variants) >= MAX_VARIANTS or float_free in self.float_free:
            self.enabled = float_free not in self.float_free  # varying floats: stop compiling
            return self.call(*values, **keywords)
        self.float_free.add(float_free)
        compiled = jax.jit(functools.partial(_call_with, self.call, positional_spec, keyword_spec))
        try:
            out = compiled(arrays)
        except _TRACE_ERRORS:
            self.enabled = False
            return self.call(*values, **keywords)
        self.variants[key] = compiled
        return out
