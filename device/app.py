"""``tierflow.device.Device``: the device's part of a plan, for embedding in an app.

A :class:`Device` wraps a :class:`~tierflow.device.client.DeviceClient` with the device's
declared preprocessing (:mod:`tierflow.device.preprocess`), so that an app hands it
frames (8-bit pictures, or image file paths) and gets one
:class:`~tierflow.device.client.Result` per frame::

    from tierflow.device import Device, DeviceClient

    with Device(DeviceClient("plan/", "edge:50051", window=32)) as device:
        result = device.infer(frame)                  # one frame, start to end
        for result in device.stream(camera_frames):   # many, pipelined, in order
            ...

A frame may also be the model inputs themselves (a mapping of name to array), which go
to the client as they are. ``stream`` keeps up to ``window`` requests in flight, and a
frame that cannot be read or preprocessed becomes a failed Result (``InputError``) in
its place, so the stream goes on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tierflow.device.client import DeviceClient, Result, Ticket
from tierflow.device.in_flight import InFlight, tagged
from tierflow.device.preprocess import Preprocess, plan_preprocess, read_image
from tierflow.device.sessions import StreamSession
from tierflow.device.sources import Frame
from tierflow.errors import InputError, TierflowError

#: What :meth:`Device.infer` and :meth:`Device.stream` take: a picture (uint8 H x W [x C],
#: RGB), an image file, a source :class:`Frame`, or the model inputs by name.
FrameLike = np.ndarray | str | Path | Frame | Mapping[str, np.ndarray]
T = TypeVar("T")


class Device:
    """The device's part of a plan: preprocess frames, run them, send the rest on.

    ``client`` runs the plan (its arguments say how: window, deadline, cache, ...); the
    Device owns it from now on and closes it in :meth:`close`. ``image_norm``
    (``--image-norm``'s forms) is used when the plan records no normalisation for its
    image input. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, client: DeviceClient, *, image_norm: str | None = None) -> None:
        self.client = client
        self.plan = client.plan
        self._image_norm = image_norm
        self._preprocess: Preprocess | None = None
        self._sessions: dict[str, StreamSession] = {}

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    @property
    def preprocess(self) -> Preprocess:
        """The preprocessing of the plan's image input (found on first use)."""
        if self._preprocess is None:
            self._preprocess = plan_preprocess(self.plan, self.client.plan_dir, self._image_norm)
        return self._preprocess

    def inputs(self, frame: FrameLike) -> dict[str, np.ndarray]:
        """The model inputs for ``frame`` (see :data:`FrameLike`)."""
        if isinstance(frame, Mapping):
            return {str(name): np.asarray(value) for name, value in frame.items()}
        picture: np.ndarray | str | Path | None = frame  # type: ignore[assignment]
        if isinstance(frame, Frame):
            if frame.tensor is not None:  # the model input itself, not a picture
                if len(self.plan.inputs) == 1:
                    return {self.plan.inputs[0]: frame.tensor}
                return {self.preprocess.name: frame.tensor}
            picture = frame.path if frame.path is not None else frame.image
        if isinstance(picture, (str, Path)):
            picture = read_image(picture)
        if picture is None:
            raise InputError("a frame holds no picture")
        return {self.preprocess.name: self.preprocess(picture)}

    def submit(self, frame: FrameLike) -> Ticket:
        """Start ``frame`` now; a frame that cannot be prepared is a failed ticket."""
        started = time.perf_counter()
        try:
            inputs = self.inputs(frame)
        except TierflowError as exc:
            return _failed(frame, started, exc)
        except (ValueError, TypeError) as exc:  # numpy on an odd array
            return _failed(frame, started, InputError(str(exc)))
        return self.client.submit(inputs)

    def infer(self, frame: FrameLike) -> Result:
        """One frame, start to end; raises its error (a TierflowError) if it failed."""
        return self.submit(frame).result().unwrap()

    def stream(
        self, frames: Iterable[FrameLike], *, session: str | None = None
    ) -> Iterator[Result]:
        """One Result per frame, in order, with up to ``window`` in flight.

        ``session``: the frames are one session's chunks of a stateful model, its state
        kept on the tier that owns it and replayed if that tier loses it
        (:class:`~tierflow.device.sessions.StreamSession`); calling again with the same
        name goes on with the session.
        """
        if session is None:
            for _, result in self.pairs(frames):
                yield result
            return
        stream = self._sessions.get(session)
        if stream is None:
            stream = self._sessions[session] = StreamSession(self.client, session)
        for _, result in stream.pairs(frames, self.inputs):
            yield result

    def pairs(self, frames: Iterable[T]) -> Iterator[tuple[T, Result]]:
        """As :meth:`stream`, each Result with the frame it answers.

        Every frame taken from ``frames`` is answered (or fails) before this ends, so a
        caller that stops the iterable gets every result of what was submitted.
        """
        window: InFlight[tuple[T, Ticket], tuple[T, Result]] = tagged(self.client.window)
        yield from window.stream(frames, lambda frame: (frame, self.submit(frame)))  # type: ignore[arg-type]


def _failed(frame: Any, started: float, error: TierflowError) -> Ticket:
    name = frame.source if isinstance(frame, Frame) else frame if isinstance(frame, str) else "-"
    ms = (time.perf_counter() - started) * 1e3
    result = Result(id=str(name), error=error, ms={"total": ms, "device": ms})
    return Ticket(str(name), started, ms, result=result)
