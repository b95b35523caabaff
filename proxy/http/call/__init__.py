"""One proxied call, from its request to its answer: the middleware and authentication,
the ``Service`` that holds the engine and its parts, admission to a slot, forwarding with
retries and fallbacks, the relay of streams, the response cache and usage accounting.
"""
