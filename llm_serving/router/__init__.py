"""Data parallelism: one HTTP front end over several serving engines (``llm-serving router``), each a whole
``llm-serving serve`` (its own agents, TP-N or not, on its own devices or host). A request goes to the engine
that most likely holds its prompt's prefix in its KV cache, unless that engine is much busier than the least
busy one (``affinity``); the proxy forwards it and streams the answer back, watches the engines' health and
serves their metrics labelled per engine (``proxy``). It knows the engines only by URL, as a client does.

May import: ``llm_serving.front`` (the engines' own HTTP guards and JSON errors, so a malformed request gets the
same JSON 4xx from the router) and ``request_errors``; nothing else of ``llm_serving`` (it speaks HTTP to the
engines).
"""
