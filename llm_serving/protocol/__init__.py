"""The master/agent protocol: the only part of ``llm_serving`` that ``agents`` may import.

- ``wire``: the pipe frames and the ``AgentSpec`` an agent process starts from;
- ``batch``: the per-step batch (or a KV copy) and its answer (numpy, token-flat);
- ``step``: what a step computes (its kind, derived once from its rows) and its descriptor;
- ``shm_channel``: the fixed shared-memory layout that carries them;
- ``model_config``: the Llama hyper-parameters and the dtypes/kernel choices both sides name;
- ``paths``: the cache root both sides write under.

Nothing here imports MindSpore or any other part of ``llm_serving`` (a test enforces both).
"""
