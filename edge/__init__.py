"""Edge agent: serves the device, runs the middle segment, may exit early, forwards to the cloud.

Imports only onnxruntime, numpy, grpcio, protobuf and zstandard, so it installs on a
Raspberry Pi or a Jetson.
"""
