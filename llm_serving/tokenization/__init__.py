"""Text in and out of token ids: the model's tokenizer and the streaming detokenizer, chat templates
(a conversation rendered and tokenized), and training the small tokenizer of the embedded default model.

May import: ``llm_serving.config`` and ``llm_serving.describe`` (how bad values are named in errors).
"""
