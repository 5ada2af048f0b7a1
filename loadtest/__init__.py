"""Load-test client for LLM servers, kept apart from the server it measures.

It turns an alpaca dataset into requests (``dataset``), sends them over HTTP the way the contest's
``test_serving_performance.py`` does (``protocol`` for one request, ``client`` for a whole run on an arrival
schedule, ``cli`` for the command line), and reports vLLM ``bench serve``-style numbers with PNG plots.

What a load test is made of and yields apart from sending it (workloads cut from the packaged corpus, datasets,
arrival schedules, per-request results, metrics, report, plots, a local server) is ``llm_serving.bench``, which
the simulator shares; this package imports that and nothing else of ``llm_serving`` (neither the server's parts
nor the agents): it talks to the server over HTTP only, so it is usable alone against any server. The
dependency is one-way: ``llm_serving`` never imports this package (but for its command line's ``bench``).
"""
