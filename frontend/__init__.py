"""OpenAI-compatible HTTP frontend: validation, chat templates, tokenization, streaming.

Its rooms, each importing only the rooms below it (tests/test_layout.py checks it):
- `http/`: the HTTP layer: raw ASGI, the request-head and nesting bounds, OpenAI-style errors,
  the frontend's metrics; it imports no other room.
- `engine/`: the engine client: sockets to the core, each request's inbox, the queue as this
  frontend sees it, admission, tenants, replicas; over `http/`.
- `grammar/`: the grammar pool and the worker process it compiles in; alone (the worker runs
  as a process of its own, importing nothing of the frontend).
- `api/`: the OpenAI routes and their schemas: request and reply bodies, prompts and chat
  templates, tools, structured output, the OpenAPI document; over all three.
`app.py` (the router) and `server.py` (the process entry) sit on top of the rooms.
"""
