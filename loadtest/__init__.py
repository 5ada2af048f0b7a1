"""Load-test tooling for LLM servers, kept apart from the server it measures.

It builds alpaca-format workloads from a packaged corpus (``workload``), sends them to an llm-serving or
OpenAI-compatible server on a chosen arrival process, the way the contest's ``test_serving_performance.py``
does (``client``), and reports vLLM ``bench serve``-style metrics with plots (``report``). It imports nothing
from ``llm_serving``: it talks to the server over HTTP only.
"""
