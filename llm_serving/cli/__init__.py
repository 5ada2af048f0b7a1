"""The ``llm-serving`` command line: ``main`` builds the parser from the commands in ``commands/`` (each module
there defines one ``COMMAND``; ``main`` names none of them), ``options`` holds what commands share. The top of
the master: it may import any part of ``llm_serving`` (and ``loadtest`` for ``bench``: the only part of the master
that imports the load-test client), and nothing imports it.
"""
