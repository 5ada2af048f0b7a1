"""The HTTP front that the engine's server (``llm_serving.api``) and the router (``llm_serving.router``) share: JSON
error bodies (``errors``), who may call (``api_key``: the Bearer key on every route but /health) and the guards in
front of every route (``guards``: the request body read within its limit and decoded per its ``Content-Encoding``,
JSON nesting bounded, the HTTP parser's own rejections as JSON). One copy, so a malformed or unauthorised request
gets the same JSON 4xx whichever of the two it reaches.

May import: ``llm_serving.request_errors``.
"""
