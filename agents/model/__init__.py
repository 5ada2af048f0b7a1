"""The Llama model as MindSpore Cells for serving: the graph (fused projections, paged KV cache, greedy argmax
in the graph), the tensor-parallel cells of one rank's slice, the ops backends (native CPU, portable graph ops,
Ascend's fused primitives and their CPU reference stand-ins) and the native C++ kernels (``kernels/``, compiled
on first use).

May import: ``llm_serving.protocol`` and ``agents.weights``.
"""
