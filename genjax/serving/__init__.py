"""Serving many users at once: the continuous-batching engine and the OpenAI-compatible server.

Empty for now; the engine (paged KV cache, scheduler, manager) and the HTTP server land here.

Layer:
    Floor 5. May import every floor below, ``generation`` included.
"""
