"""What crosses between tiers: messages, streams and channel security.

``wire`` converts tensors and errors to and from the generated messages (``tierflow.rpc``)
and validates them where they enter; ``stream_client`` is the client end of one long-lived
``Infer`` stream with many requests in flight; ``security`` builds TLS credentials and
tokens for channels and servers.
"""
