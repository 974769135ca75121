"""Device runtime: runs the first segment and streams features to the edge.

Imports only onnxruntime, numpy, grpcio, protobuf and zstandard. :class:`Device`
(``tierflow.device.Device``, from :mod:`tierflow.device.app`) is the API for embedding
in an app; it is imported on first use, so that importing a submodule stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierflow.device.app import Device

__all__ = ["Device"]


def __getattr__(name: str) -> Any:
    if name == "Device":
        from tierflow.device.app import Device

        return Device
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
