"""Running the model in an agent process: the model runner (numpy step batches in, next tokens out over
warmed-up graph shapes, bucket plans, ragged and mixed steps), the sampler, graph calls without per-call
checks, the device context and compile cache, the collectives of a tensor-parallel rank, and the stand-in runner
that answers without a model.

May import: ``llm_serving.protocol``, ``agents.weights`` and ``agents.model``.
"""
