"""Model weights in the agents' canonical fused layout (fused QKV and gate/up): loading Hugging Face safetensors
or MindSpore checkpoints, a tensor-parallel rank's slice read alone, conversion to our checkpoint, MindFormers'
names both ways, and the panel packing of projection weights for the native linear kernels. Plain numpy where it
can be, so the master-independent tools and tests load weights without building a graph.

May import: ``llm_serving.protocol`` only.
"""
