"""tierflow: run one neural network across a device, an edge server and the cloud.

The shared core lives here (wire codec, generated gRPC stubs, plan schema, link model,
CLI entry, errors). The tiers are sub-packages: ``tierflow.partitioner`` (offline
planning), ``tierflow.device``, ``tierflow.edge`` and ``tierflow.cloud`` (runtimes).
Nothing in this package imports torch or onnx at import time.
"""

from __future__ import annotations

__version__ = "0.1.0"
