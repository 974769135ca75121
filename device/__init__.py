"""Device runtime: runs the first segment and streams features to the edge.

Imports only onnxruntime, numpy, grpcio, protobuf and zstandard.
"""
