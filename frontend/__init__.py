"""OpenAI-compatible HTTP frontend: validation, chat templates, tokenization, streaming."""
