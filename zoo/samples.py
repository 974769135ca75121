"""Real inputs without downloads: photos that ship inside packages, text drawn with Pillow.

Every function returns uint8 RGB images [N,H,W,3], deterministic for a seed, so a
benchmark and a test see the same requests. :func:`normalise` turns them into the float
tensors the models in :mod:`tierflow.zoo.real` take. Pillow's bundled font (Aileron,
through ``ImageFont.load_default(size)``) draws the text; scikit-learn's two sample
photos (a temple and a flower, 427x640) give the photographic content of the pages, and
:func:`photo_views` crops camera-like views of every photo the installed packages ship
(scikit-learn's, matplotlib's and scikit-image's, :data:`SHIPPED_PHOTOS`) for the
ImageNet classifiers.

Needs Pillow and scikit-learn's files (the ``models`` extra); imported only by tools that plan
or measure, never by a runtime tier.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import ModelError, UsageError

_WORDS = (
    "edge", "cloud", "device", "split", "network", "layer", "feature", "latency", "bandwidth",
    "memory", "model", "tensor", "camera", "frame", "request", "answer", "codec", "stream",
    "plan", "profile", "budget", "quality", "image", "text", "page", "table", "figure", "title",
    "caption", "header", "footer", "reference", "equation", "section", "result", "method",
    "data", "measure", "rate", "bytes", "time", "cache", "exit", "early", "server", "client",
    "link", "route", "batch",
)  # fmt: skip

# ImageNet statistics, which both Paddle image models here were trained with.
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def normalise(images: np.ndarray, kind: str) -> np.ndarray:
    """uint8 RGB [N,H,W,3] -> float32 [N,3,H,W].

    ``imagenet``: (x/255 - mean) / std per channel; ``signed``: x/127.5 - 1 (PP-OCR).
    """
    scaled = images.astype(np.float32) / np.float32(255.0)
    if kind == "imagenet":
        scaled = (scaled - _MEAN) / _STD
    elif kind == "signed":
        scaled = scaled * np.float32(2.0) - np.float32(1.0)
    else:
        raise UsageError(f"unknown normalisation {kind!r}: expected imagenet or signed")
    return np.ascontiguousarray(scaled.transpose(0, 3, 1, 2), dtype=np.float32)


@cache
def _photos() -> tuple[np.ndarray, ...]:
    """scikit-learn's sample photos, read from the package's files.

    The same arrays ``sklearn.datasets.load_sample_images()`` returns, without importing
    scikit-learn (seconds on a busy machine).
    """
    import importlib.util

    from PIL import Image

    spec = importlib.util.find_spec("sklearn")
    folders = [] if spec is None else list(spec.submodule_search_locations or [])
    for folder in folders:
        files = sorted((Path(folder) / "datasets" / "images").glob("*.jpg"))
        if files:
            return tuple(np.asarray(Image.open(f).convert("RGB"), dtype=np.uint8) for f in files)
    raise ModelError("scikit-learn's sample photos were not found: pip install 'tierflow[models]'")


@cache
def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def photo_crops(count: int, size: int = 224, *, seed: int = 0) -> np.ndarray:
    """``count`` crops of scikit-learn's sample photos, ``size`` x ``size``.

    Each crop picks a photo, a scale (the crop covers 35-100% of the photo's height) and a
    position at random, then resizes with Pillow's bicubic filter: different content per
    request, as frames from a camera would be.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = _photos()
    crops = np.empty((count, size, size, 3), dtype=np.uint8)
    for i in range(count):
        photo = photos[int(rng.integers(len(photos)))]
        height, width = photo.shape[:2]
        side = int(height * rng.uniform(0.35, 1.0))
        top = int(rng.integers(0, height - side + 1))
        left = int(rng.integers(0, width - side + 1))
        patch = Image.fromarray(photo[top : top + side, left : left + side])
        crops[i] = np.asarray(patch.resize((size, size), Image.Resampling.BICUBIC))
    return crops


#: Real photographs that packages carry in their wheels: (package, folder, file). Only
#: colour or grey photographs of scenes and objects; charts, textures made by a program
#: and microscopy are left out.
SHIPPED_PHOTOS: tuple[tuple[str, str, str], ...] = (
    ("sklearn", "datasets/images", "china.jpg"),
    ("sklearn", "datasets/images", "flower.jpg"),
    ("matplotlib", "mpl-data/sample_data", "grace_hopper.jpg"),
    ("skimage", "data", "astronaut.png"),
    ("skimage", "data", "chelsea.png"),
    ("skimage", "data", "coffee.png"),
    ("skimage", "data", "rocket.jpg"),
    ("skimage", "data", "motorcycle_left.png"),
    ("skimage", "data", "hubble_deep_field.jpg"),
    ("skimage", "data", "camera.png"),
    ("skimage", "data", "brick.png"),
    ("skimage", "data", "grass.png"),
    ("skimage", "data", "gravel.png"),
    ("skimage", "data", "retina.jpg"),
)


@cache
def shipped_photos() -> tuple[tuple[str, np.ndarray], ...]:
    """Every photo of :data:`SHIPPED_PHOTOS` whose package is installed, as (name, RGB).

    Files are found through the import system's spec of each package (nothing is
    imported); grey photos become three equal channels. Raises :class:`ModelError` when
    none is found.
    """
    import importlib.util

    from PIL import Image

    found: list[tuple[str, np.ndarray]] = []
    for package, folder, name in SHIPPED_PHOTOS:
        spec = importlib.util.find_spec(package)
        for root in [] if spec is None else list(spec.submodule_search_locations or []):
            path = Path(root) / folder / name
            if path.is_file():
                image = Image.open(path).convert("RGB")
                found.append((f"{package}:{name}", np.asarray(image, dtype=np.uint8)))
                break
    if not found:
        raise ModelError("no shipped photo was found: pip install 'tierflow[models]'")
    return tuple(found)


def photo_views(count: int, size: int = 224, *, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """``count`` square views of the shipped photos, ``size`` x ``size``, and each one's photo.

    View ``i`` is of photo ``i mod P`` (every photo contributes alike); its side is a
    random 30-100% of the photo's shorter side, its position random, and it is mirrored
    left-right with probability one half, then resized with Pillow's bicubic filter: how a
    camera framing one scene differently from frame to frame would see it. Different
    seeds give different views of the same photos (disjoint pixel for pixel in practice,
    not in content: say so where it matters).
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = shipped_photos()
    views = np.empty((count, size, size, 3), dtype=np.uint8)
    names: list[str] = []
    for i in range(count):
        name, photo = photos[i % len(photos)]
        height, width = photo.shape[:2]
        side = max(16, int(min(height, width) * rng.uniform(0.3, 1.0)))
        top = int(rng.integers(0, height - side + 1))
        left = int(rng.integers(0, width - side + 1))
        patch = Image.fromarray(photo[top : top + side, left : left + side])
        if rng.random() < 0.5:
            patch = patch.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        views[i] = np.asarray(patch.resize((size, size), Image.Resampling.BICUBIC))
        names.append(name)
    return views, names


def _sentence(rng: np.random.Generator, words: int) -> str:
    chosen = [_WORDS[int(k)] for k in rng.integers(0, len(_WORDS), size=words)]
    if rng.random() < 0.5:
        chosen.append(str(int(rng.integers(0, 10_000))))
    return " ".join(chosen).capitalize()


def text_lines(
    count: int, height: int = 48, width: int = 320, *, seed: int = 0
) -> tuple[np.ndarray, list[str]]:
    """``count`` lines of dark text on light paper, as an OCR recogniser takes them, and the text.

    Words, font size (24-34 px), offset and ink/paper greys vary by request; the line
    fills most of the width, as a text detector's crop would.
    """
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    lines = np.empty((count, height, width, 3), dtype=np.uint8)
    texts: list[str] = []
    for i in range(count):
        paper = int(rng.integers(215, 256))
        ink = int(rng.integers(0, 70))
        image = Image.new("RGB", (width, height), (paper, paper, paper))
        draw = ImageDraw.Draw(image)
        font = _font(int(rng.integers(24, 35)))
        text = _sentence(rng, 2)
        while draw.textlength(text, font=font) > width - 8 and " " in text:
            text = text.rsplit(" ", 1)[0]
        top = int(rng.integers(2, 8))
        draw.text((int(rng.integers(2, 8)), top), text, fill=(ink, ink, ink), font=font)
        lines[i] = np.asarray(image)
        texts.append(text)
    return lines, texts


def document_pages(count: int, height: int = 800, width: int = 608, *, seed: int = 0) -> np.ndarray:
    """``count`` document pages: a title, paragraphs, a figure with caption, a ruled table.

    What a layout detector is trained to find; the figure is a crop of a sample photo,
    paragraph count and order vary by request.
    """
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    pages = np.empty((count, height, width, 3), dtype=np.uint8)
    margin = 40
    for i in range(count):
        image = Image.new("RGB", (width, height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        y = margin
        draw.text((margin, y), _sentence(rng, 4).title(), fill=(0, 0, 0), font=_font(28))
        y += 60
        blocks = ["text", "figure", "text", "table", "text"]
        order = rng.permutation(len(blocks))
        for kind in (blocks[k] for k in order):
            if y > height - 140:
                break
            if kind == "text":
                y = _paragraph(draw, rng, margin, y, width - 2 * margin) + 24
            elif kind == "figure":
                side = int(rng.integers(140, 200))
                crop = photo_crops(1, side, seed=int(rng.integers(1 << 30)))[0]
                image.paste(Image.fromarray(crop), (int((width - side) / 2), y))
                y += side + 8
                caption = "Figure " + str(int(rng.integers(1, 9))) + ": " + _sentence(rng, 5)
                draw.text((margin + 40, y), caption, fill=(0, 0, 0), font=_font(15))
                y += 40
            else:
                y = _table(draw, rng, margin, y, width - 2 * margin) + 24
        pages[i] = np.asarray(image)
    return pages


def _paragraph(draw: Any, rng: np.random.Generator, left: int, top: int, width: int) -> int:
    font = _font(16)
    y = top
    for _ in range(int(rng.integers(3, 7))):
        line = _sentence(rng, 12)
        while draw.textlength(line, font=font) > width and " " in line:
            line = line.rsplit(" ", 1)[0]
        draw.text((left, y), line, fill=(20, 20, 20), font=font)
        y += 22
    return y


def _table(draw: Any, rng: np.random.Generator, left: int, top: int, width: int) -> int:
    rows, cols = int(rng.integers(3, 6)), int(rng.integers(3, 5))
    cell_w, cell_h = width // cols, 26
    font = _font(14)
    for r in range(rows):
        for c in range(cols):
            x, y = left + c * cell_w, top + r * cell_h
            draw.rectangle((x, y, x + cell_w, y + cell_h), outline=(0, 0, 0))
            word = _WORDS[int(rng.integers(len(_WORDS)))] if r == 0 else f"{rng.random():.3f}"
            draw.text((x + 6, y + 5), word, fill=(0, 0, 0), font=font)
    return top + rows * cell_h


def rotated_pages(count: int, size: int = 224, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Page crops turned by 0, 90, 180 or 270 degrees, and the angle index of each (0-3).

    What the orientation classifier judges: the top of a document page (title and
    paragraphs), cropped square and resized to ``size``.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    pages = document_pages(count, seed=seed)
    turns = rng.integers(0, 4, size=count)
    out = np.empty((count, size, size, 3), dtype=np.uint8)
    for i, page in enumerate(pages):
        side = page.shape[1]
        top = int(rng.integers(0, page.shape[0] - side + 1))
        square = Image.fromarray(page[top : top + side]).resize((size, size), Image.Resampling.BOX)
        out[i] = np.rot90(np.asarray(square), k=int(turns[i]))
    return out, turns.astype(np.int64)
