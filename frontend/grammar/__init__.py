"""The grammar pool: untrusted grammars compiled in worker processes that can be stopped."""
