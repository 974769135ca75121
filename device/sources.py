"""Where ``tierflow device`` gets its frames: a camera, a folder of images, or stdin.

Each source is an iterator of :class:`Frame`: what it came from (a file name, or a frame
number counted from 0) and the picture, or for stdin possibly the model input itself.
Every source checks ``stop`` (a :class:`threading.Event`) between frames and ends when
it is set, so that a signal ends the stream after the frame being read.

- **camera** (``/dev/videoN``, or an index ``N``): OpenCV's ``VideoCapture``, needs the
  ``camera`` extra (opencv-python-headless); frames are converted from OpenCV's BGR to RGB.
  The stream ends when the camera gives no more frames.
- **folder**: its PNG and JPEG files in name order, each read once; with ``watch``, the
  folder is then polled every ``poll_s`` for files not seen before, until ``stop``. A file
  is taken once its size has stayed the same over one poll, so a file being copied in is
  not read half-written.
- **stdin** (``-``): a stream of NumPy ``.npy`` arrays one after another (what repeated
  ``numpy.save(sys.stdout.buffer, a)`` writes). A uint8 array of H x W or H x W x C is a
  frame and is preprocessed like a file; any other array is the model input tensor as is.
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from tierflow.errors import InputError, UsageError, shown
from tierflow.extras import import_extra

#: Image files a folder source reads (by suffix, any case).
IMAGE_SUFFIXES: tuple[str, ...] = (".png", ".jpg", ".jpeg")
DEFAULT_POLL_S = 0.5
_CAMERA = re.compile(r"^(/dev/video\d+|\d+)$")


@dataclass(frozen=True)
class Frame:
    """One item of a source: ``source`` names it (file name or frame number).

    ``image`` is an 8-bit picture (H x W x C, RGB) to preprocess; ``path`` an image file
    to read and preprocess (read when the frame is run, so that a file that cannot be read
    fails alone); ``tensor`` (stdin only) is the model input given as is. Exactly one is set.
    """

    source: str | int
    image: np.ndarray | None = None
    path: Path | None = None
    tensor: np.ndarray | None = None


def source_kind(text: str) -> str:
    """``camera``, ``folder`` or ``stdin`` for a ``--source``; a UsageError otherwise."""
    if text == "-":
        return "stdin"
    if Path(text).is_dir():
        return "folder"
    if _CAMERA.match(text):
        return "camera"
    raise UsageError(
        f"--source {shown(text)} is neither a folder, a camera (/dev/videoN or an index) "
        "nor - (stdin)"
    )


def folder_frames(
    folder: str | Path,
    *,
    watch: bool = False,
    stop: threading.Event | None = None,
    poll_s: float = DEFAULT_POLL_S,
) -> Iterator[Frame]:
    """The folder's images in name order; with ``watch``, then new ones until ``stop``."""
    stop = stop or threading.Event()
    folder = Path(folder)
    seen: set[str] = set()
    sizes: dict[str, int] = {}  # files seen growing or new at the last poll
    first = True
    while not stop.is_set():
        ready = []
        for path in sorted(folder.iterdir()):
            if path.name in seen or path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if not path.is_file():
                continue
            size = path.stat().st_size
            if first or sizes.get(path.name) == size:
                ready.append(path)
            else:
                sizes[path.name] = size
        for path in ready:
            if stop.is_set():
                return
            seen.add(path.name)
            sizes.pop(path.name, None)
            yield Frame(path.name, path=path)
        first = False
        if not watch:
            return
        stop.wait(poll_s)


def camera_frames(device: str, *, stop: threading.Event | None = None) -> Iterator[Frame]:
    """Frames from a camera (``/dev/videoN`` or an index) until it ends or ``stop``."""
    cv2 = import_extra("cv2", "--source CAMERA")
    stop = stop or threading.Event()
    capture = cv2.VideoCapture(int(device) if device.isdigit() else device)
    if not capture.isOpened():
        raise UsageError(f"cannot open camera {device}")
    try:
        number = 0
        while not stop.is_set():
            ok, bgr = capture.read()
            if not ok:
                return
            yield Frame(number, image=np.ascontiguousarray(bgr[:, :, ::-1]))
            number += 1
    finally:
        capture.release()


def stdin_frames(stream: BinaryIO, *, stop: threading.Event | None = None) -> Iterator[Frame]:
    """``.npy`` arrays one after another on ``stream``, until it ends or ``stop``.

    ``stream`` may be a pipe: it is only read, never sought (:func:`read_npy`).
    """
    stop = stop or threading.Event()
    number = 0
    while not stop.is_set():
        array = read_npy(stream, f"stdin item {number}")
        if array is None:  # the stream ended between arrays
            return
        if array.dtype == np.uint8 and array.ndim in (2, 3):
            yield Frame(number, image=array)
        else:
            yield Frame(number, tensor=array)
        number += 1


_NPY_MAGIC = b"\x93NUMPY"
_CHUNK = 1 << 20
_MAX_HEADER = 10_000  # numpy's own limit for headers it parses safely


def _read_up_to(stream: BinaryIO, size: int) -> bytearray:
    """``size`` bytes, or fewer if the stream ends first; read in chunks of at most 1 MiB."""
    data = bytearray()
    while len(data) < size:
        chunk = stream.read(min(size - len(data), _CHUNK))
        if not chunk:
            break
        data += chunk
    return data


def read_npy(stream: BinaryIO, what: str) -> np.ndarray | None:
    """One ``.npy`` array from ``stream`` without seeking; None if it ends before one starts.

    ``numpy.load`` seeks back after checking the magic string and reads the data with
    ``fromfile``, both of which fail on a pipe ("File or stream is not seekable"). This
    reads the magic string, the header (parsed by ``numpy.lib.format``) and exactly the
    data it announces. Arrays of Python objects (pickles) are refused.
    """
    magic = _read_up_to(stream, len(_NPY_MAGIC) + 2)
    if not magic:
        return None
    if len(magic) < len(_NPY_MAGIC) + 2 or not magic.startswith(_NPY_MAGIC):
        raise InputError(
            f"{what} is not a .npy array: it starts with {bytes(magic)!r}, not {_NPY_MAGIC!r}"
        )
    version = (magic[-2], magic[-1])
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise InputError(f"{what} is a .npy array of format version {version}, not 1, 2 or 3")
    length = _read_up_to(stream, 2 if version == (1, 0) else 4)
    if int.from_bytes(length, "little") > _MAX_HEADER:
        raise InputError(
            f"{what} announces a .npy header of {int.from_bytes(length, 'little')} bytes; "
            f"at most {_MAX_HEADER} are read"
        )
    header = _read_up_to(stream, int.from_bytes(length, "little"))
    parse = np.lib.format.read_array_header_1_0
    if version != (1, 0):
        parse = np.lib.format.read_array_header_2_0
    try:  # numpy's own parser checks the header (a dict literal) and its size
        shape, fortran_order, dtype = parse(io.BytesIO(bytes(length + header)))
    except ValueError as exc:
        raise InputError(f"{what} has a malformed .npy header: {exc}") from exc
    if dtype.hasobject:
        raise InputError(f"{what} holds Python objects (a pickle); only plain arrays are read")
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data = _read_up_to(stream, size)
    if len(data) < size:
        raise InputError(f"{what} ends after {len(data)} of its {size} data bytes")
    array = np.frombuffer(data, dtype=dtype) if size else np.empty(0, dtype)
    return array.reshape(shape, order="F" if fortran_order else "C")


def check_source(text: str, *, watch: bool = False) -> str:
    """``--source TEXT``'s kind, once what reading it needs is known to be here.

    Called before the device connects: a wrong source, ``--watch`` on what is no folder,
    or a missing library is one line, not one per frame (a folder's images need Pillow,
    a camera OpenCV).
    """
    kind = source_kind(text)
    if watch and kind != "folder":
        raise UsageError("--watch watches a folder; --source is not one")
    if kind == "folder":
        import_extra("PIL.Image", "--source DIR (reading its images)")
    elif kind == "camera":
        import_extra("cv2", "--source CAMERA")
    return kind


def open_source(
    text: str,
    *,
    watch: bool = False,
    stop: threading.Event | None = None,
    stdin: BinaryIO | None = None,
    poll_s: float = DEFAULT_POLL_S,
) -> Iterator[Frame]:
    """The frames of ``--source TEXT`` (see the module docstring)."""
    kind = check_source(text, watch=watch)
    if kind == "folder":
        return folder_frames(text, watch=watch, stop=stop, poll_s=poll_s)
    if kind == "camera":
        return camera_frames(text, stop=stop)
    if stdin is None:
        import sys

        stdin = sys.stdin.buffer
    return stdin_frames(stdin, stop=stop)
