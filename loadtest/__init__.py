"""Load-test tooling for LLM servers, kept apart from the server it measures.

It builds alpaca-format workloads from a packaged corpus (``workload``), turns an alpaca dataset into requests
(``dataset``), sends them over HTTP the way the contest's ``test_serving_performance.py`` does (``protocol``
for one request, ``client`` for a whole run on an arrival schedule, ``cli`` for the command line), and reports
vLLM ``bench serve``-style numbers (``metrics``, ``report``) with PNG plots (``plots``). It imports nothing
from ``llm_serving``: it talks to the server over HTTP only.
"""


class BenchError(ValueError):
    """Bad flags, dataset or target: the run cannot start."""
