"""The HTTP layer: raw ASGI, request bounds, OpenAI-style errors, the frontend's metrics."""
