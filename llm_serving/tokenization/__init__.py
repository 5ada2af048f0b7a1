"""Text in and out of token ids: the model's tokenizer and the streaming detokenizer, chat templates
(a conversation rendered and tokenized), and training the small tokenizer of the embedded default model.

May import: ``llm_serving.config``, ``llm_serving.describe`` (how bad values are named in errors),
``llm_serving.request_errors`` (why a request is refused) and ``llm_serving.bench`` (the packaged corpus the
default tokenizer is trained on).
"""
