"""The HTTP front end (aiohttp) over an engine: the server and what every route shares (guards, JSON
responses and errors, metrics, one request's generation), the request schemas, and one routes module per API
(llm-serving/TGI, OpenAI completions, OpenAI chat). Routes see the server only through the small interface in
``route_context``; ``launch`` runs the whole serving process (engine + HTTP, graceful drain).

May import: ``llm_serving.protocol``, ``core``, ``config``, ``tokenization``, ``engine``, ``executor``,
``describe``, ``request_errors`` and ``front`` (the guards and JSON errors shared with the router).
"""
