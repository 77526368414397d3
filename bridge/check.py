"""`bridge check FILE`: before running a saved graph, which of its ops the bridge runs how.

Reads a `torch.export` program (`.pt2`) and lists its ATen ops by the rung of the fallback ladder
each would take (a table entry, derived from one, decomposed into entries, or eager torch on the
host CPU), with how many nodes call each; the graph's control flow (`torch.cond`, `map`) counts
as translated where a rule exists. Nothing runs. Exit code 0 when every op runs on the bridge
device, 1 when some would fall back to the CPU or cannot run.
"""

from __future__ import annotations

import collections
import os
import sys

import torch

# The bridge's rules for torch's higher-order ops (op_mappings/control_flow.py).
_CONTROL_FLOW = ("cond", "map_impl")


def _nodes(graph_module):
    """Every call in the graph and in the graphs of its submodules (control flow's branches)."""
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function":
                    yield node.target


def census(exported: torch.export.ExportedProgram) -> dict:
    """{status: {op name: node count}} for the program's graph."""
    from bridge.activation import activate, is_active
    from bridge.runtime import ladder
    from bridge.runtime.registry import MAPPINGS

    if not is_active():
        activate()  # the tables
    counts = collections.Counter(_nodes(exported.graph_module))
    statuses: dict = collections.defaultdict(dict)
    for target, count in counts.items():
        if isinstance(target, torch._ops.OpOverload):
            status = ladder.aten_status(target, MAPPINGS, {})
        elif isinstance(target, torch._ops.HigherOrderOperator):
            status = "control flow (jax.lax)" if target._name in _CONTROL_FLOW else ladder.UNSUPPORTED
        else:
            status = "Python call (runs as it is)"
        name = getattr(target, "__name__", None) if not isinstance(target, torch._ops.OperatorBase) else str(target)
        statuses[status][name or str(target)] = count
    return dict(statuses)


def main(path: str) -> int:
    from bridge.runtime import ladder

    if not os.path.exists(path):
        print(f"bridge check: no such file: {path}", file=sys.stderr)
        return 2
    if path.endswith(".onnx"):
        return _check_onnx(path)
    if path.endswith((".pt", ".pth", ".torchscript")):
        # TorchScript: its nodes by rung, and those without translation (runtime/torchscript.py).
        from bridge.activation import activate, is_active
        from bridge.runtime import torchscript
        from bridge.runtime.errors import SavedModelError

        try:
            scripted = torchscript.load(path)
        except SavedModelError as error:
            print(f"bridge check: {error}", file=sys.stderr)
            return 2
        if not is_active():
            activate()  # the tables
        statuses = torchscript.census(scripted)
    elif not path.endswith(".pt2"):
        print(f"bridge check: {path}: only torch.export programs (.pt2) and TorchScript archives (.pt) can be read yet", file=sys.stderr)
        return 2
    else:
        statuses = census(torch.export.load(path))
    for status, ops in sorted(statuses.items()):
        print(f"{status}: {len(ops)} op(s), {sum(ops.values())} node(s)")
        for name, count in sorted(ops.items(), key=lambda item: (-item[1], item[0])):
            print(f"  {count:5d}  {name}")
    stuck = sum(len(statuses.get(status, {})) for status in (ladder.CPU_FALLBACK, ladder.UNSUPPORTED, "no translation"))
    if stuck:
        print(f"bridge check: {stuck} op(s) would not run on the bridge device (above)", file=sys.stderr)
    return 1 if stuck else 0


def _check_onnx(path: str) -> int:
    """An ONNX model's nodes (its subgraphs' too) by op: mapped by the ONNX table, expanded by
    the ONNX standard's function of the op, or with no mapping; nothing runs."""
    from bridge.op_mappings import onnx_ops  # noqa: F401  (registers the ONNX table)
    from bridge.runtime import onnx_graph
    from bridge.runtime.errors import BridgeError

    try:
        model = onnx_graph.read_model(path)
        opsets = onnx_graph.opsets_of(model, path)
    except BridgeError as error:
        print(f"bridge check: {error}", file=sys.stderr)
        return 2
    print(f"{path}: ai.onnx opset {opsets.get('', '(none)')}, {len(model.graph.initializer)} initializer(s)")
    statuses = onnx_graph.unmapped_nodes(model, onnx_graph.ONNX_OPS)
    for status, ops in sorted(statuses.items()):
        print(f"{status}: {len(ops)} op(s), {sum(ops.values())} node(s)")
        for name, count in sorted(ops.items(), key=lambda item: (-item[1], item[0])):
            print(f"  {count:5d}  {name}")
    missing = statuses.get("no mapping", {})
    if missing:
        print(f"bridge check: {len(missing)} op(s) of {path} have no mapping (above): bridge.load would stop at "
              "their first node", file=sys.stderr)
    return 1 if missing else 0
