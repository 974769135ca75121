"""EfficientNet-Lite0 from its package's ImageNet checkpoint, on views of shipped photos."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tierflow.errors import ModelError
from tierflow.zoo import imagenet, samples

needs_weights = pytest.mark.skipif(
    importlib.util.find_spec(imagenet.WEIGHTS_PACKAGE) is None
    or importlib.util.find_spec(imagenet.CODE_PACKAGE) is None,
    reason="the EfficientNet-Lite0 packages are not installed (tierflow[models])",
)


def test_photo_views_are_deterministic_and_cover_every_photo() -> None:
    views, names = samples.photo_views(30, seed=4)
    again, _ = samples.photo_views(30, seed=4)
    other, _ = samples.photo_views(30, seed=5)
    photos = [name for name, _ in samples.shipped_photos()]
    assert views.shape == (30, 224, 224, 3) and views.dtype == np.uint8
    assert np.array_equal(views, again)
    assert names[: len(photos)] == photos  # round robin: every photo in turn
    seen = {v.tobytes() for v in views}
    assert not any(v.tobytes() in seen for v in other)  # another seed, other views
    assert len(photos) >= 2  # scikit-learn's two at least


def test_tensors_refuse_another_size() -> None:
    with pytest.raises(ModelError, match="224x224"):
        imagenet.tensors(np.zeros((1, 100, 100, 3), dtype=np.uint8))


def test_tensors_apply_the_lite_normalisation() -> None:
    pixels = np.full((1, 224, 224, 3), 255, dtype=np.uint8)
    tensor = imagenet.tensors(pixels)
    assert tensor.shape == (1, 1, 3, 224, 224)
    assert np.allclose(tensor, (255 - 127) / 128)


@pytest.mark.integration
@needs_weights
def test_the_exported_classifier_knows_a_cat_from_a_coffee_cup(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Random or misloaded weights, or the wrong normalisation, fail this."""
    import onnxruntime as ort
    from PIL import Image

    path = imagenet.model_path(tmp_path)
    assert imagenet.model_path(tmp_path) == path  # cached
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    photos = dict(samples.shipped_photos())
    if "skimage:chelsea.png" not in photos:
        pytest.skip("scikit-image's photos are not installed")
    wanted = {"skimage:chelsea.png": range(281, 286), "skimage:coffee.png": (967, 968, 504)}
    for name, classes in wanted.items():
        image = Image.fromarray(photos[name]).resize((224, 224), Image.Resampling.BICUBIC)
        tensor = imagenet.tensors(np.asarray(image)[None])[0]
        logits = session.run(None, {imagenet.INPUT: tensor})[0]
        assert logits.shape == (1, 1000)
        assert int(logits.argmax()) in classes, (name, int(logits.argmax()))
