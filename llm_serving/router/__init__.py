"""Data parallelism: one HTTP front end over several serving engines (``llm-serving router``), each a whole
``llm-serving serve`` (its own agents, TP-N or not, on its own devices or host). A request goes to the engine
that most likely holds its prompt's prefix in its KV cache, unless that engine is much busier than the least
busy one (``affinity``); the proxy forwards it and streams the answer back, watches the engines' health and
serves their metrics labelled per engine (``proxy``). It knows the engines only by URL, as a client does.

May import: nothing else of ``llm_serving`` (it speaks HTTP to the engines).
"""
