"""The serving simulator and tuner: the engine's own scheduler, block manager and prefix cache (``core``) driven
by a virtual clock, each step's time from a cost model (fitted to steps measured here, or analytic for a device we
cannot measure), and a search over the scheduling configuration on it. No agents, no HTTP: a run of thousands of
requests takes seconds. Reports in the load tool's terms (``loadtest.metrics``, its report and plots).

May import: ``llm_serving.protocol``, ``core``, ``config``, ``tokenization``, ``models`` and ``engine``.
"""
