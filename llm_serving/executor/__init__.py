"""The master's side of the device agents (vLLM's "executor"): one process per rank started, watched and
replaced, one step sent to all ranks through shared memory and its result read back, and what MindSpore's
collectives need from the master for a tensor-parallel pool. Agents are reached only through
``llm_serving.protocol`` (wire frames, the shared-memory layout) and process arguments, never by import.

May import: ``llm_serving.protocol`` only.
"""
