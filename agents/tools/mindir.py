"""Writing a runner's warm-up graphs to MindIR and reading a MindIR file back: its op types (counted), inputs and
outputs as MindSpore inferred them (``read_mindir``), and node by node (``read_graph``): each op's inputs traced to
what feeds them (a named graph input, a Parameter, a constant with its value, or another op), the ground a check
of each fused op's contract stands on (an export alone proves only that a graph builds).

Kept apart from ``agents.tools.export`` (which builds our runner) so the mindformers backend's export, in its own
MindSpore 2.7.2 environment, writes, names, describes and parses its graphs the same way. A graph's file name and
line come from the runner's graph family of its shape (``GraphFamily.unit`` and ``tag``) and its input names from
the MindIR itself (the step cell's ``construct`` parameters), so no table here repeats them.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from mindspore.train import mind_ir_pb2

from agents.runtime.graph_call import dynamic_inputs

# the fused NPU primitives of the Ascend backend, in the order the summary lists them
FUSED_PRIMITIVES = ("ReshapeAndCache", "PagedAttention", "FlashAttentionScore", "ApplyRotaryPosEmb", "RmsNorm",
                    "Swiglu", "ArgMaxWithValue")
_DTYPE_NAMES = {"INT32": "int32", "INT64": "int64", "FLOAT": "float32", "FLOAT16": "float16", "BFLOAT16": "bfloat16"}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # numpy-style: int32, float16, ...
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class GraphSummary:
    """What a MindIR file holds: its op types (counted), graph inputs and outputs as MindSpore inferred them, and
    the inferred outputs of the first node of each op type."""

    path: Path
    ops: Counter
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    op_outputs: dict[str, tuple[TensorInfo, ...]]
    input_names: tuple[str, ...] = ()  # the graph inputs' names, as ``construct`` names its parameters

    def fused(self) -> dict[str, int]:
        return {name: self.ops[name] for name in FUSED_PRIMITIVES if self.ops[name]}


def _tensor_info(proto) -> TensorInfo:
    name = mind_ir_pb2.TensorProto.DataType.Name(proto.data_type)
    return TensorInfo(_DTYPE_NAMES.get(name, name.lower()), tuple(int(d) for d in proto.dims))


def _attr_tensors(attr) -> tuple[TensorInfo, ...]:
    """The tensors of a (possibly tuple) inferred-type attribute."""
    return tuple(_tensor_info(t) for t in attr.tensors) + tuple(
        _tensor_info(t) for value in attr.values for t in value.tensors)


def read_mindir(path: str | Path) -> GraphSummary:
    """Parse a MindIR file (``mind_ir_pb2.ModelProto``): node op types such as ``REF::PagedAttention:40`` are
    counted by primitive name; the output tuple's types come from the graph output's ``attr_info``."""
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(Path(path).read_bytes())
    graph = model.graph
    ops: Counter = Counter()
    op_outputs: dict[str, tuple[TensorInfo, ...]] = {}
    for node in graph.node:
        name = re.sub(r"^REF::|:\d+$", "", node.op_type)
        ops[name] += 1
        shape = next((a for a in node.attribute if a.name == "shape"), None)
        if name not in op_outputs and shape is not None:
            op_outputs[name] = _attr_tensors(shape)
    inputs = tuple(_tensor_info(i.tensor[0]) for i in graph.input if i.tensor)
    prefix = _name_prefix(graph)
    names = tuple(_short(i.name, prefix) for i in graph.input if i.tensor)
    outputs: list[TensorInfo] = []
    for out in graph.output:
        outputs += [_tensor_info(t) for t in out.tensor] if out.tensor else list(_attr_tensors(out.attr_info))
    return GraphSummary(Path(path), ops, inputs, tuple(outputs), op_outputs, names)


@dataclass(frozen=True)
class Source:
    """What feeds one input of an op. ``kind``: ``input`` (a graph input, by its name in ``construct``),
    ``parameter`` (a Parameter, by name), ``constant`` (``value``: int, float, bool, str, None, a tuple of them, or a
    constant tensor's ``TensorInfo``) or ``node`` (computed in the graph by op ``op``). ``Load`` and ``Depend`` are
    looked through: they pass their first input on unchanged."""

    kind: str
    name: str
    op: str | None = None
    value: Any = None
    info: TensorInfo | None = None
    array: np.ndarray | None = field(default=None, compare=False, repr=False)  # a small constant tensor's values


@dataclass(frozen=True)
class OpNode:
    op: str  # the primitive's name, e.g. PagedAttention
    name: str
    inputs: tuple[Source, ...]  # in the primitive's argument order (2.10 passes its attributes as inputs too)
    outputs: tuple[TensorInfo, ...]  # as MindSpore inferred them
    # attributes a primitive keeps as such (older-style ones: AllReduce's group and op, AllGather's rank_size)
    attrs: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class GraphNodes:
    path: Path
    inputs: dict[str, TensorInfo]  # graph inputs by name, in order
    nodes: tuple[OpNode, ...]

    def of(self, op: str) -> list[OpNode]:
        return [n for n in self.nodes if n.op == op]

    def producer(self, source: Source) -> OpNode | None:
        """The op node a ``node`` source comes from (None for graph inputs, Parameters and constants)."""
        return next((n for n in self.nodes if n.name == source.name), None) if source.kind == "node" else None


_PASS_THROUGH = ("Load", "Depend")
_NUMPY_TYPES = {"FLOAT16": np.float16, "FLOAT": np.float32, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8,
                "INT8": np.int8, "BOOL": np.bool_}
MAX_CONSTANT_VALUES = 1 << 16  # constant tensors up to this many values keep them (masks; not weight tables)
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "UINT32", "UINT64"}


def _constant(attr) -> Any:
    """A Constant node's value from its ``value`` attribute (MindIR's AttributeProto)."""
    kind = mind_ir_pb2.AttributeProto.AttributeType.Name(attr.type)
    if kind in _INT_TYPES:
        return int(attr.i)
    if kind == "BOOL":
        return bool(attr.i)
    if kind == "FLOAT":
        return float(attr.f)
    if kind == "DOUBLE":
        return float(attr.d)
    if kind == "STRING":
        return attr.s.decode()
    if kind == "NONE":
        return None
    if kind in ("TENSOR", "TENSORS"):
        tensors = [attr.t] if kind == "TENSOR" else list(attr.tensors)
        return _tensor_info(tensors[0]) if tensors else None
    if kind in ("TUPLE", "LIST"):
        return tuple(_constant(v) for v in attr.values)
    return kind.lower()  # monads and the like: markers, not values


def _constant_array(attr) -> np.ndarray | None:
    """A small constant tensor's values (bfloat16 widened to float32), or None."""
    tensors = [attr.t] if attr.HasField("t") else list(attr.tensors)
    if len(tensors) != 1 or not tensors[0].raw_data:
        return None
    t = tensors[0]
    kind, shape = mind_ir_pb2.TensorProto.DataType.Name(t.data_type), tuple(int(d) for d in t.dims)
    if kind == "BFLOAT16":
        raw = np.frombuffer(t.raw_data, np.uint16)
        values = (raw.astype(np.uint32) << 16).view(np.float32)
    elif kind in _NUMPY_TYPES:
        values = np.frombuffer(t.raw_data, _NUMPY_TYPES[kind])
    else:
        return None
    return values.reshape(shape) if values.size <= MAX_CONSTANT_VALUES and values.size == np.prod(shape) else None


def _name_prefix(graph) -> str:
    """Exported names may carry the graph's own name (``5_1___main___Net_construct_4:q``): the prefix to drop."""
    names = [i.name for i in graph.input] + [p.name for p in graph.parameter]
    return names[0].rpartition(":")[0] + ":" if names and ":" in names[0] else ""


def _short(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def read_graph(path: str | Path) -> GraphNodes:
    """Every op node of a MindIR file with its inputs traced to their sources (see ``Source``)."""
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(Path(path).read_bytes())
    graph = model.graph
    attrs = {prim.name: {a.name: _constant(a) for a in prim.attribute} for prim in model.primitives}
    prefix = _name_prefix(graph)  # inputs and parameters are shown without it
    sources: dict[str, Source] = {}
    inputs: dict[str, TensorInfo] = {}
    for i in graph.input:
        info = _tensor_info(i.tensor[0]) if i.tensor else None
        sources[i.name] = Source("input", _short(i.name, prefix), info=info)
        if info is not None:
            inputs[_short(i.name, prefix)] = info
    for param in graph.parameter:
        sources[param.name] = Source("parameter", _short(param.name, prefix), info=_tensor_info(param))
    nodes = []
    for node in graph.node:
        if node.op_type == "Constant":
            value = _constant(node.attribute[0]) if node.attribute else None
            array = _constant_array(node.attribute[0]) if isinstance(value, TensorInfo) else None
            sources[node.name] = Source("constant", node.name, value=value, array=array)
            continue
        op = re.sub(r"^REF::|:\d+$", "", node.op_type)
        args = tuple(sources.get(name, Source("node", name)) for name in node.input)
        if op in _PASS_THROUGH and args:
            sources[node.name] = args[0]
            continue
        shape = next((a for a in node.attribute if a.name == "shape"), None)
        outputs = _attr_tensors(shape) if shape is not None else ()
        sources[node.name] = Source("node", node.name, op=op, info=outputs[0] if len(outputs) == 1 else None)
        nodes.append(OpNode(op, node.name, args, outputs, attrs.get(node.op_type.removeprefix("REF::"), {})))
    return GraphNodes(Path(path), inputs, tuple(nodes))


def graph_file_name(shape: tuple, tag: str, label: str = "") -> str:
    """``decode_b8_w16``, ``ragged_b4_t128``, ``mindformers_decode_b8_w16`` (label mindformers): the shape with its
    family's ``tag`` before n (MindSpore adds ``.mindir``)."""
    kind, batch, n = shape
    return (f"{label}_" if label else "") + f"{kind}_b{batch}_{tag}{n}"


def describe(shape: tuple, unit: str, summary: GraphSummary, label: str = "") -> str:
    """One line per graph: its shape (n counted in its family's ``unit``), named inputs, outputs and fused
    primitives."""
    kind, batch, n = shape
    inputs = " ".join(f"{name}={info}" for name, info in zip(summary.input_names, summary.inputs))
    fused = ", ".join(f"{name} x{count}" for name, count in summary.fused().items()) or "none"
    if summary.ops["Custom"]:  # the native CPU backend's C++ ops
        fused += f"; native Custom x{summary.ops['Custom']}"
    outputs = ", ".join(map(str, summary.outputs))
    return ((f"{label} " if label else "") + f"{kind} batch={batch} {unit}={n}: inputs {inputs}; outputs (ids, "
            f"logprobs, logits) {outputs}; fused {fused} -> {summary.path}")


def export_shapes(runner, graph_of: Callable[[str], nn.Cell], out_dir: str | Path, shapes: list[tuple],
                  progress: Callable[[str], None] | None = None,
                  dynamic: bool = False) -> list[tuple[tuple, GraphSummary]]:
    """Export each shape's graph (``graph_of(kind)``) to ``out_dir`` with the inputs the runner's warm-up runs it
    with (``runner.warmup_inputs(shape)``), named and described by the runner's family of its kind
    (``runner.family(kind)``, an ``agents.runtime.graph_runner.FamilyRunner``'s, and ``runner.label``), and read
    each file back. ``dynamic``: with those inputs' dimensions left open (one graph per family serves every
    shape), named ``KIND_dynamic``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for shape in shapes:
        family = runner.family(shape[0])
        arrays = runner.warmup_inputs(shape)
        if dynamic:
            path = out / ((f"{runner.label}_" if runner.label else "") + f"{shape[0]}_dynamic")
            inputs = dynamic_inputs(arrays)
        else:
            path = out / graph_file_name(shape, family.tag, runner.label)
            inputs = [Tensor(a) for a in arrays]
        ms.export(graph_of(shape[0]), *inputs, file_name=str(path), file_format="MINDIR")
        summary = read_mindir(path.with_suffix(".mindir"))
        done.append((shape, summary))
        if progress:
            progress(describe(shape, family.unit, summary, runner.label))
    return done


def parse_shape(text: str) -> tuple:
    """``KIND:BATCH:N`` (an export command's ``--shape``) as a warm-up shape."""
    kind, _, rest = text.partition(":")
    try:
        batch, n = (int(v) for v in rest.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KIND:BATCH:N (e.g. decode:8:16), got {text!r}") from None
    return kind, batch, n
