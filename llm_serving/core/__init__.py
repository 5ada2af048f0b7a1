"""The engine core's bookkeeping, pure and synchronous: the continuous-batching scheduler (admission order,
chunked prefill, decode batches), the paged KV cache manager (over its block allocator and the prefix cache)
and the sequence each request becomes. No I/O, no threads, no processes: every decision here can be tested by
calling it.

May import: ``llm_serving.protocol`` and ``llm_serving.request_errors`` (why a request is refused) only.
"""
