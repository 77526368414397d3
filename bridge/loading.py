"""`bridge.load`: a model saved as a whole graph, run as one XLA program.

    program = bridge.load("model.pt2")        # or an ExportedProgram
    out = program(x)                          # torch tensors in, bridge tensors out
    program.jax_function, program.state       # the same program for code that stays in JAX

Today: `torch.export` programs (`.pt2` files from `torch.export.save`, or ExportedProgram
objects) and TorchScript (`.pt` archives from `torch.jit.save`, or modules and functions from
`torch.jit.trace`/`torch.jit.script`). ONNX files are not read yet.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from bridge.runtime import export, random, torchscript
from bridge.runtime.tensor import BridgeTensor, numpy_to_torch, read_value, to_bridge, write_value


class LoadedProgram:
    """A whole graph as one jitted JAX function over its state; called with torch tensors.

    Each call passes the state (parameters, buffers, constants) and the inputs to the program
    and keeps the state it returns, so buffers the graph writes (BatchNorm's running statistics)
    carry over from call to call as in torch; inputs the graph writes in place are written."""

    def __init__(self, exported: torch.export.ExportedProgram):
        self.exported = exported
        self.jax_function, self.state = export.to_jax(exported)
        self._compiled = jax.jit(self.jax_function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [to_bridge(value) if _on_host(value) else value for value in flat]
        arrays = [read_value(value) if isinstance(value, BridgeTensor) else value for value in tensors]
        call_args, call_kwargs = pytree.tree_unflatten(arrays, spec)
        outputs, self.state, written = self._compiled(self.state, *call_args, key=random.next_key(), **call_kwargs)
        for given, tensor, after in zip(flat, tensors, written):
            if isinstance(tensor, BridgeTensor) and after is not None:
                if given is tensor:
                    write_value(tensor, after)
                else:  # a host tensor the program wrote: as torch would have written it
                    given.copy_(numpy_to_torch(np.asarray(after)))
        return pytree.tree_map(lambda leaf: BridgeTensor(leaf, 0) if isinstance(leaf, jax.Array) else leaf, outputs)

    def state_dict(self) -> dict:
        """The program's current state as torch CPU tensors (loads into the exported module)."""
        return {name: numpy_to_torch(np.array(value)) for name, value in self.state.items()}


class LoadedScript(LoadedProgram):
    """A TorchScript module or function (runtime/torchscript.py) with LoadedProgram's calls and
    state; `scripted` is the ScriptModule or ScriptFunction it was read from."""

    def __init__(self, scripted: Any, source: Any = None):
        self.scripted = scripted
        self.jax_function, self.state = torchscript.to_jax(scripted, source)
        self._compiled = jax.jit(self.jax_function)


# File names TorchScript archives go by (torch.jit.save writes any name it is given).
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".torchscript")


def _on_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, BridgeTensor)


def load(source: Any) -> LoadedProgram:
    """A saved graph as a callable on the bridge device: a `torch.export` file (`.pt2`) or an
    ExportedProgram. Activates the bridge if it is not active (the graph runs through its
    tables)."""
    from bridge.activation import activate, is_active

    if not is_active():
        activate()
    if isinstance(source, torch.export.ExportedProgram):
        return LoadedProgram(source)
    if isinstance(source, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        return LoadedScript(source)
    path = os.fspath(source)
    if path.endswith(".pt2"):
        return LoadedProgram(torch.export.load(path))
    if path.endswith(TORCHSCRIPT_SUFFIXES):
        return LoadedScript(torchscript.load(path), path)
    if path.endswith(".onnx"):
        return _load_onnx(path)
    kind = "an ONNX model" if path.endswith(".onnx") else "this kind of file"
    raise NotImplementedError(
        f"bridge.load({path!r}): {kind} cannot be loaded yet; only torch.export programs (.pt2) and TorchScript archives (.pt) can. "
        "Export the model with torch.export.export and torch.export.save, or run the script that "
        "builds it under the bridge."
    )


def _load_onnx(path: str) -> Any:
    """An ONNX file as runtime/onnx_graph.OnnxProgram: its graph through the ONNX table."""
    from bridge.op_mappings import onnx_ops  # noqa: F401  (registers the ONNX table; needs the onnx extra)
    from bridge.runtime import onnx_graph

    return onnx_graph.OnnxProgram(path, onnx_graph.ONNX_OPS)
