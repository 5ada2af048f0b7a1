"""Writing a runner's warm-up graphs to MindIR and reading a MindIR file back: its op types (counted), inputs and
outputs as MindSpore inferred them.

Kept apart from ``agents.tools.export`` (which builds our runner) so the mindformers backend's export, in its own
MindSpore 2.7.2 environment, writes and parses its graphs the same way.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
from mindspore import Tensor, nn
from mindspore.train import mind_ir_pb2

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
    outputs: list[TensorInfo] = []
    for out in graph.output:
        outputs += [_tensor_info(t) for t in out.tensor] if out.tensor else list(_attr_tensors(out.attr_info))
    return GraphSummary(Path(path), ops, inputs, tuple(outputs), op_outputs)


def export_shapes(runner, graph_of: Callable[[str], nn.Cell], out_dir: str | Path, shapes: list[tuple],
                  file_name: Callable[[tuple], str], describe: Callable[[tuple, GraphSummary], str],
                  progress: Callable[[str], None] | None = None) -> list[tuple[tuple, GraphSummary]]:
    """Export each shape's graph (``graph_of(kind)``) to ``out_dir`` with the inputs the runner's warm-up runs it
    with (``runner.warmup_inputs(shape)``), and read each file back."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for shape in shapes:
        path = out / file_name(shape)
        inputs = [Tensor(a) for a in runner.warmup_inputs(shape)]
        ms.export(graph_of(shape[0]), *inputs, file_name=str(path), file_format="MINDIR")
        summary = read_mindir(path.with_suffix(".mindir"))
        done.append((shape, summary))
        if progress:
            progress(describe(shape, summary))
    return done


def parse_shape(text: str) -> tuple:
    """``KIND:BATCH:N`` (an export command's ``--shape``) as a warm-up shape."""
    kind, _, rest = text.partition(":")
    try:
        batch, n = (int(v) for v in rest.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KIND:BATCH:N (e.g. decode:8:16), got {text!r}") from None
    return kind, batch, n
