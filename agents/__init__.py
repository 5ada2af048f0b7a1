"""The device agents: one process per device/rank (``python -m agents.agent_main``), started by the master,
each running warmed-up MindSpore Llama graphs over a paged KV cache. From ``llm_serving`` they import only
``llm_serving.protocol``.

Packages, lowest first (each may import those before it): ``weights`` (checkpoints in the fused layout,
tensor-parallel shards, conversion, the native kernels' panel packing), ``model`` (the Llama graph,
tensor-parallel cells, ops backends and the native C++ kernels), ``runtime`` (the model runner and sampler, graph
calls and compile cache, collectives, the stand-in), ``tools`` (MindIR export, in-process generation),
``mindformers`` (MindFormers' Llama behind the runner interface, its own environment). ``agent_main`` is the
process on top of them all.
"""
