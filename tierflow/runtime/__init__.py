"""The one runtime every tier runs: ONNX Runtime sessions, the request path, the server.

Read in this order: ``sessions`` (opening a segment in ONNX Runtime) and
``segment_runner`` (running a tier's segments and their exits); ``segment_store`` (the
bounded store of segment files, fetched from the tier above); ``service`` (the ``Tier``
gRPC service); ``server`` (health, signals, shutdown); ``admission`` (stream limits);
``metrics`` (Prometheus); ``processes`` (starting ``tierflow serve`` as a child).
"""
