"""``llm-serving preflight``'s checks, shipped with the package (an installed wheel has no tests/): each fused op
alone against its numpy reference (``ops``, ``references``, ``op_checks``), the int8 PagedAttention antiquant
direction, a one-layer and a whole-model step against an independent reference and the graph-call path
(``model_check``), the first compile of each graph family (``graphs``). ``python -m agents.tools.preflight`` runs
one kernel selection's checks in its own process; the verdict's format is ``llm_serving.protocol.preflight_verdict``.
"""
