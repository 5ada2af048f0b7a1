"""What a load test is made of and what it yields, apart from sending it: alpaca workloads cut from the packaged
corpus (``workload``), a dataset read and checked (``dataset``), the arrival schedule (``arrivals``), one
request's result (``results``), vLLM ``bench serve``-style numbers (``metrics``), their console and markdown
renderings (``report``), PNG plots (``plots``), a run's saved files (``run_files``) and a local
``llm-serving serve`` to measure (``local_server``).

Both the load-test client (the top-level ``loadtest`` package, which sends the requests over HTTP) and the
simulator (``llm_serving.simulator``, which serves them on a virtual clock) speak these terms, so a simulated run
and a measured one are reported and compared alike. They live here, on the master's side, and the dependency is
one-way: ``loadtest`` imports this package (and nothing else of ``llm_serving``), the master never imports
``loadtest`` (its command line aside, which offers the client as ``llm-serving bench``). That way round the
client stays an HTTP-only tool usable alone against any server: this package holds no part of the server
(no engine, scheduler, tokenizer nor MindSpore; numpy, aiohttp and matplotlib only), and the simulator, which
is part of the server's package, does not depend on a client.

May import: nothing else of ``llm_serving``.
"""


class BenchError(ValueError):
    """Bad flags, dataset or target: the run cannot start."""
