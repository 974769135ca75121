"""Device runtime: runs the first segment and streams features to the edge.

Imports only onnxruntime, numpy, grpcio, protobuf and zstandard. :class:`Device`
(``tierflow.device.Device``, from :mod:`tierflow.device.app`) is the API for embedding
in an app, around the :class:`DeviceClient` it is given (from
:mod:`tierflow.device.client`); both are imported on first use, so that importing a
submodule stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierflow.device.app import Device
    from tierflow.device.client import DeviceClient

__all__ = ["Device", "DeviceClient"]


def __getattr__(name: str) -> Any:
    if name == "Device":
        from tierflow.device.app import Device

        return Device
    if name == "DeviceClient":
        from tierflow.device.client import DeviceClient

        return DeviceClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
