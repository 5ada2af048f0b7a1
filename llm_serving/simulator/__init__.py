"""The serving simulator and tuner: the engine's own scheduler, block manager and prefix cache (``core``) driven
by a virtual clock, each step's time from a cost model (fitted to steps measured here, or analytic for a device we
cannot measure), and a search over the scheduling configuration on it. No agents, no HTTP: a run of thousands of
requests takes seconds. Reports in the load test's terms (``llm_serving.bench``: its results, metrics, report
and plots), which the load-test client shares.

May import: ``llm_serving.protocol``, ``core``, ``config``, ``tokenization``, ``models``, ``engine`` and ``bench``.
"""
