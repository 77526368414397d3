"""Symbolic sizes: a graph traced under `jax.export`'s shape polymorphism, its dimension
variables seen by torch as SymInts.

While a trace with symbolic input shapes runs (`tracing`), each dimension variable of the JAX
trace is a symbol of a torch ShapeEnv of its own, with the program's example size as its hint and
its range as its bounds. Bridge tensors report SymInt sizes (`torch_shape`), so torch's meta
kernels, its decompositions and the graph's own size arithmetic (`sym_size`, `x.view(b * s, -1)`)
compute with symbols; a size that reaches a table entry is read back as a JAX dimension
expression (`jax_arguments`). A test of sizes that torch decides at the example sizes (a branch
on one, which would hold only for some sizes) is found after the node that made it (`new_decision`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import itertools
from typing import Any, Iterator, Optional

import jax
import sympy
import torch

from .errors import SymbolicShapeError


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One dimension variable: its name in the JAX trace, an example size torch's guards are
    decided at, and its bounds (upper None: unbounded)."""

    name: str
    hint: int
    lower: int = 1
    upper: Optional[int] = None


def _traced_lower(dimension: Dimension) -> int:
    """The least size torch decides tests for: 2, as torch.export traces (sizes 0 and 1, where
    broadcasting and empty tensors differ, are the special cases it leaves to the program)."""
    return max(dimension.lower, 2)


class SymbolicSizes:
    """The torch symbols standing for one trace's dimension variables, both ways."""

    def __init__(self, dimensions: list, scope: Any):
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        # (duck_shape off: two dimensions with equal examples stay two symbols)
        self.shape_env = ShapeEnv(duck_shape=False)
        self.scope = scope
        self.names = {}  # torch symbol -> JAX dimension variable name
        self.sizes = {}  # JAX dimension variable name -> torch SymInt
        for dimension in dimensions:
            symbol = self.shape_env.create_symbol(
                dimension.hint, ConstantSource(dimension.name), dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True
            )
            upper = dimension.upper if dimension.upper is not None else sympy.oo
            self.shape_env.constrain_symbol_range(symbol, compiler_min=_traced_lower(dimension), compiler_max=upper)
            self.names[symbol] = dimension.name
            self.sizes[dimension.name] = self.shape_env.create_symintnode(symbol, hint=dimension.hint)
        self._decided = len(self.shape_env.guards)  # the guards new_decision has looked at
        # sizes a guard is tried at: each bound, one past the lower, the example and one past it
        self._samples = {
            symbol: sorted({_traced_lower(dimension), _traced_lower(dimension) + 1, dimension.hint, dimension.hint + 1, dimension.upper or 1 << 20})
            for symbol, dimension in zip(self.names, dimensions)
        }
        self._torch = {}  # JAX dimension expression -> SymInt
        self._jax = {}  # sympy expression -> JAX dimension expression

    def torch_size(self, size: Any) -> Any:
        """A JAX dimension (an int or a dimension expression) as torch's size."""
        if isinstance(size, int):
            return size
        known = self._torch.get(size)
        if known is None:
            known = self._torch[size] = _evaluate(ast.parse(str(size), mode="eval").body, self.sizes)
        return known

    def jax_size(self, size: torch.SymInt) -> Any:
        """A torch SymInt as a JAX dimension expression (an int where torch knows its value)."""
        return self._expression(self.shape_env.replace(size.node.expr))

    def jax_value(self, value: Any) -> Any:
        """`value` with its SymInts as dimension expressions and its SymBools (a test of sizes, as
        `torch.cond(x.shape[0] > 2, ...)` takes) as JAX booleans computed from the sizes."""
        if isinstance(value, torch.SymInt):
            return self.jax_size(value)
        if isinstance(value, (list, tuple)) and any(isinstance(item, (torch.SymInt, torch.SymBool, list, tuple)) for item in value):
            return type(value)(self.jax_value(item) for item in value)
        if isinstance(value, torch.SymBool):
            return self._condition(self.shape_env.replace(value.node.expr))
        if isinstance(value, torch.SymFloat):
            expression = self.shape_env.replace(value.node.expr)
            if expression.is_number:
                return float(expression)
            raise SymbolicShapeError(f"the symbolic float {value} reaches a table entry; only integer sizes and their tests can stay symbolic")
        return value

    def _condition(self, expression: sympy.Basic) -> Any:
        if expression in (sympy.true, sympy.false):
            return bool(expression)
        compare = _COMPARISONS.get(type(expression))
        if compare is None:
            raise SymbolicShapeError(f"the test {expression} of sizes has no JAX form")
        left, right = (self._expression(side) for side in expression.args)
        return compare(jax.numpy.asarray(left), jax.numpy.asarray(right))

    def _expression(self, expression: sympy.Expr) -> Any:
        if expression.is_number:
            return int(expression)
        known = self._jax.get(expression)
        if known is None:
            text = jax_text(expression, self.names)
            known = self._jax[expression] = jax.export.symbolic_shape(text, scope=self.scope)[0]
        return known

    def names_in(self, values: list) -> list:
        """The dimension variables in the sizes of `values` (tensors, sizes, lists of them)."""
        symbols = set()
        for value in values:
            for item in value if isinstance(value, (list, tuple)) else [value]:
                sizes = item.shape if isinstance(item, torch.Tensor) else [item]
                for size in sizes:
                    if isinstance(size, (torch.SymInt, torch.SymBool, torch.SymFloat)):
                        symbols |= self.shape_env.replace(size.node.expr).free_symbols
        return sorted(self.names[symbol] for symbol in symbols if symbol in self.names)

    def new_decision(self) -> Optional[str]:
        """The first test of sizes torch decided at the example sizes since the last call (a
        guard) that fails for some sizes in the bounds (`s77 > 8`, `Eq(s77, 5)`), as text in the
        trace's dimension names; None if none. torch records a guard wherever its bounds alone
        do not decide a test, so one that holds at the corners of the bounds and around the
        examples (`Ne(s27*s77, s77)`, true for sizes of at least 2) is taken to hold for all."""
        guards = self.shape_env.guards
        found = None
        for guard in guards[self._decided :]:
            if found is None and not self._holds_around(guard.expr):
                found = str(guard.expr.xreplace({symbol: sympy.Symbol(name) for symbol, name in self.names.items()}))
        self._decided = len(guards)
        return found

    def _holds_around(self, expression: sympy.Basic) -> bool:
        symbols = sorted((symbol for symbol in expression.free_symbols if symbol in self.names), key=str)
        choices = [self._samples[symbol] for symbol in symbols]
        for values in itertools.product(*choices):
            if not bool(expression.xreplace(dict(zip(symbols, map(sympy.Integer, values))))):
                return False
        return True

    def example(self) -> str:
        return ", ".join(f"{name} = {size.node.hint}" for name, size in self.sizes.items())


# The sizes of the trace in progress, or None.
current: Optional[SymbolicSizes] = None


@contextlib.contextmanager
def tracing(sizes: SymbolicSizes) -> Iterator[SymbolicSizes]:
    global current
    outer, current = current, sizes
    try:
        yield sizes
    finally:
        current = outer


def torch_shape(shape: tuple) -> tuple:
    """A JAX array's shape as torch's sizes (SymInts for its dimension expressions)."""
    if current is None:
        raise SymbolicShapeError(
            f"an array of symbolic shape {shape} reached torch outside a trace of a whole graph: only runtime/export.py's "
            "functions take symbolic shapes"
        )
    return tuple(current.torch_size(size) for size in shape)


def jax_arguments(values: list, keywords: dict) -> tuple[list, dict]:
    """A table entry's arguments with torch's SymInts as JAX dimension expressions."""
    if current is None:
        return values, keywords
    return [current.jax_value(value) for value in values], {name: current.jax_value(value) for name, value in keywords.items()}


def jax_value(value: Any) -> Any:
    return value if current is None else current.jax_value(value)


def is_symbolic(shape: tuple) -> bool:
    return any(not isinstance(size, int) for size in shape)


# ---------------------------------------------------------------- expressions, both ways


def _evaluate(node: ast.AST, sizes: dict) -> Any:
    """A JAX dimension expression (as `str` writes it, the syntax `jax.export.symbolic_shape`
    reads) computed with torch SymInts for its variables."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return sizes[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, sizes)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left, sizes), _evaluate(node.right, sizes))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
        return _CALLS[node.func.id](*(_evaluate(argument, sizes) for argument in node.args))
    raise SymbolicShapeError(f"the dimension expression {ast.unparse(node)} has no torch form")


_COMPARISONS = {
    sympy.Lt: lambda a, b: a < b,
    sympy.Le: lambda a, b: a <= b,
    sympy.Gt: lambda a, b: a > b,
    sympy.Ge: lambda a, b: a >= b,
    sympy.Eq: lambda a, b: a == b,
    sympy.Ne: lambda a, b: a != b,
}
_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}
_CALLS = {
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "max": lambda a, b: torch.sym_max(a, b),
    "min": lambda a, b: torch.sym_min(a, b),
}


def jax_text(expression: sympy.Expr, names: dict) -> str:
    """A sympy size expression of torch's as the text `jax.export.symbolic_shape` reads."""
    from torch.utils._sympy import functions

    if expression.is_Integer:
        return str(int(expression))
    if expression.is_Symbol:
        if expression not in names:
            raise SymbolicShapeError(f"the size {expression} is none of the program's dimensions (a size computed from data)")
        return names[expression]
    arguments = [jax_text(argument, names) for argument in expression.args]
    if isinstance(expression, sympy.Add):
        return "(" + " + ".join(arguments) + ")"
    if isinstance(expression, sympy.Mul):
        return "(" + " * ".join(arguments) + ")"
    if isinstance(expression, sympy.Pow) and expression.exp.is_Integer and int(expression.exp) > 0:
        return "(" + " * ".join([arguments[0]] * int(expression.exp)) + ")"
    if isinstance(expression, (functions.FloorDiv, functions.CleanDiv)):
        return f"floordiv({arguments[0]}, {arguments[1]})"
    if isinstance(expression, (functions.Mod, functions.PythonMod)):
        return f"mod({arguments[0]}, {arguments[1]})"
    if isinstance(expression, (functions.Max, functions.Min, sympy.Max, sympy.Min)):
        name = "max" if isinstance(expression, (functions.Max, sympy.Max)) else "min"
        text = arguments[0]
        for argument in arguments[1:]:
            text = f"{name}({text}, {argument})"
        return text
    raise SymbolicShapeError(f"the size {expression} ({type(expression).__name__}) has no jax.export form")
