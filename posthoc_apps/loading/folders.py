"""Image folders (ImageNet layout) as loaders, with the model's own preprocessing.

Labelled folders follow ``torchvision.datasets.ImageFolder``: one sub-folder per class, sorted
names giving the class index (ImageNet's ``n01440764 ...`` folders sort into the standard class
order). An OOD folder may also be a flat folder of images; its labels are ignored.

The preprocessing is the model's evaluation transform: timm's ``resolve_data_config`` +
``create_transform`` for timm models and for file-defined models that declare a ``pretrained_cfg`` (timm's
``input_size``, ``mean``, ``std``, ``crop_pct``), the weights' ``transforms()`` for torchvision models; the
:class:`TransformFlags` (``--channels``, ``--mean``, ``--std``, ``--resize``, ``--crop``) set it instead. A
file-defined model with neither gets timm's ImageNet default (resize to 1/0.875 of 224, crop 224, ImageNet mean and
std), with a warning. Training images get the same transform (no augmentation): post-hoc methods fit on what the
model sees at test time. :func:`describe_transform` is the line the report prints.

Example:
    >>> transform = model_transform(model, "timm:resnet50")  # ImageNet folders  # doctest: +SKIP
    >>> train = image_folder("imagenet/train", transform, subset=10_000)  # doctest: +SKIP
    >>> check_classes(train, head_size(model, train), "imagenet/train")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, random_split

from posthoc.core.inputs import run_model
from posthoc.errors import InputError
from posthoc_apps.loading.models import ModelSpec, parse_model_spec

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
Transform = Callable[[Image.Image], torch.Tensor]


@dataclass(frozen=True)
class TransformFlags:
    """The preprocessing the command line sets: ``channels`` (1: grey images), per-channel ``mean`` and ``std`` (of
    pixels in [0, 1]), the shorter side ``resize`` and the centre ``crop``; ``None`` leaves it to the model's own."""

    channels: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    resize: int | None = None
    crop: int | None = None

    def given(self) -> bool:
        return any(value is not None for value in astuple(self))


def describe_transform(transform: Transform) -> str:
    """The preprocessing as one line, its steps in order.

    Example:
        >>> from torchvision import transforms
        >>> from posthoc_apps.loading.folders import describe_transform
        >>> describe_transform(transforms.Compose([transforms.CenterCrop(28), transforms.ToTensor()]))
        'CenterCrop(size=(28, 28)) -> ToTensor()'
    """
    steps = getattr(transform, "transforms", None) or [transform]
    return " -> ".join(re.sub(r"\s+", " ", repr(step)).replace("( ", "(").replace(" )", ")") for step in steps)


def flagged_transform(model: nn.Module, flags: TransformFlags, image_size: int | None = None) -> Transform:
    """The preprocessing the ``flags`` set; what they leave out comes from the model's timm data config (ImageNet's
    where it declares none).

    Example:
        >>> import torch
        >>> from posthoc_apps.loading.folders import TransformFlags, describe_transform, flagged_transform
        >>> flags = TransformFlags(channels=1, mean=(0.13,), std=(0.31,), resize=28, crop=28)
        >>> describe_transform(flagged_transform(torch.nn.Linear(2, 2), flags)).split(" -> ")
        ['Grayscale(num_output_channels=1)', 'Resize(size=28, interpolation=bilinear, max_size=None, antialias=True)', \
'CenterCrop(size=(28, 28))', 'ToTensor()', 'Normalize(mean=(0.13,), std=(0.31,))']
    """
    from timm.data import resolve_data_config
    from torchvision import transforms

    config = resolve_data_config({}, model=model)
    crop = flags.crop or image_size or config["input_size"][-1]
    resize = flags.resize or round(crop / config.get("crop_pct", 0.875))
    channels = flags.channels or 3
    mean = flags.mean or tuple(config["mean"])[:channels]
    std = flags.std or tuple(config["std"])[:channels]
    if len(mean) not in (1, channels) or len(std) not in (1, channels):
        raise InputError(f"--mean and --std take 1 or {channels} values (one per channel), got {mean} and {std}")
    steps = [transforms.Grayscale(1)] if channels == 1 else []
    steps += [
        transforms.Resize(resize, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(crop),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ]
    return transforms.Compose(steps)


def model_transform(
    model: nn.Module, spec: str | ModelSpec, image_size: int | None = None, flags: TransformFlags | None = None
) -> Transform:
    """The evaluation preprocessing of ``model`` (module docs); ``image_size`` overrides the crop size (resize scaled
    alike); ``flags`` set it instead of the model's own.

    Example:
        >>> import torchvision
        >>> from posthoc_apps.loading.folders import model_transform
        >>> model_transform(torchvision.models.resnet18(), "torchvision:resnet18")
        ImageClassification(
            crop_size=[224]
            resize_size=[256]
            mean=[0.485, 0.456, 0.406]
            std=[0.229, 0.224, 0.225]
            interpolation=InterpolationMode.BILINEAR
        )
    """
    spec = parse_model_spec(spec) if isinstance(spec, str) else spec
    if flags is not None and flags.given():
        return flagged_transform(model, flags, image_size)
    if spec.source == "torchvision":
        import torchvision

        weights = torchvision.models.get_model_weights(spec.name).DEFAULT
        if image_size is None:
            return weights.transforms()
        default = weights.transforms()
        ratio = default.resize_size[0] / default.crop_size[0]
        return weights.transforms(crop_size=image_size, resize_size=round(image_size * ratio))
    from timm.data import create_transform, resolve_data_config

    if spec.source != "timm" and not getattr(model, "pretrained_cfg", None):
        warnings.warn(
            f"{spec.name} declares no preprocessing (no pretrained_cfg): using timm's ImageNet default (224-px crop, "
            "ImageNet mean and std); if the model was trained otherwise, set --channels, --mean, --std, --resize and "
            "--crop (the report's Data section prints the transform used)",
            UserWarning,
            stacklevel=2,
        )
    override = {} if image_size is None else {"input_size": (3, image_size, image_size)}
    return create_transform(**resolve_data_config(override, model=model))


class FlatImageFolder(Dataset):
    """Every image directly inside ``root`` (no class sub-folders), labelled ``-1``."""

    def __init__(self, root: str | os.PathLike, transform: Transform) -> None:
        self.root = Path(root)
        self.files = sorted(p for p in self.root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        self.transform = transform
        self.classes: list[str] = []

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[index]) as image:
            return self.transform(image.convert("RGB")), -1


def _check_root(root: str | os.PathLike) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"image folder {root} does not exist or is not a directory")
    return root


def image_folder(
    root: str | os.PathLike, transform: Transform, *, subset: int | None = None, seed: int = 0, allow_flat: bool = False
) -> Dataset:
    """An ``ImageFolder`` at ``root`` (a flat folder too if ``allow_flat``), optionally ``subset`` random images.

    The returned dataset has ``.classes`` (sorted class folder names) and ``.root``.

    Example:
        >>> val = image_folder("imagenet/val", transform, subset=5_000)  # an ImageNet folder  # doctest: +SKIP
        >>> len(val), len(val.classes)  # doctest: +SKIP
        (5000, 1000)
    """
    import torchvision

    root = _check_root(root)
    has_class_dirs = any(p.is_dir() for p in root.iterdir())
    if not has_class_dirs and allow_flat:
        dataset: Dataset = FlatImageFolder(root, transform)
    else:
        try:
            dataset = torchvision.datasets.ImageFolder(root, transform=transform)
        except (FileNotFoundError, RuntimeError) as err:
            raise InputError(
                f"{root} is not an image folder: {err}. Lay it out as ROOT/CLASS_NAME/image.jpg "
                "(one sub-folder per class, as ImageNet's train and val folders)"
            ) from err
    if len(dataset) == 0:
        raise InputError(f"{root} holds no images (looked for {', '.join(IMAGE_SUFFIXES)})")
    return take_subset(dataset, subset, seed=seed)


def take_subset(dataset: Dataset, size: int | None, *, seed: int = 0) -> Dataset:
    """``size`` examples of ``dataset`` drawn at random with ``seed`` (all of it if ``size`` is None or larger).

    The result keeps the ``classes`` and ``root`` of the full dataset.
    """
    if size is None or size >= len(dataset):
        return dataset
    if size < 1:
        raise InputError(f"a subset size must be a positive integer, got {size}")
    index = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:size]
    return _keep_meta(Subset(dataset, index.tolist()), dataset)


def _keep_meta(part: Dataset, full: Dataset) -> Dataset:
    part.classes = list(getattr(full, "classes", []))
    part.root = getattr(full, "root", None)
    return part


def split_held_out(dataset: Dataset, calibration_fraction: float = 0.5, *, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Split a labelled held-out set into a calibration part (fitting) and a test part (evaluation).

    Example:
        >>> calibration, test = split_held_out(val, 0.5)  # doctest: +SKIP
    """
    if not 0 < calibration_fraction < 1:
        raise InputError(f"the calibration fraction must lie in (0, 1), got {calibration_fraction}")
    n_cal = int(round(len(dataset) * calibration_fraction))
    if n_cal < 1 or n_cal >= len(dataset):
        raise InputError(
            f"cannot split {len(dataset)} held-out images into calibration and test parts; pass more images "
            "or a separate calibration folder"
        )
    calibration, test = random_split(
        dataset, [n_cal, len(dataset) - n_cal], generator=torch.Generator().manual_seed(seed)
    )
    return _keep_meta(calibration, dataset), _keep_meta(test, dataset)


@torch.no_grad()
def head_size(model: nn.Module, dataset: Dataset) -> int:
    """Number of classes ``model`` outputs, from one forward pass on the first image of ``dataset``.

    The model's train/eval flag is left as it was.
    """
    x, _ = dataset[0]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    model.eval()
    try:
        logits = run_model(model, x.unsqueeze(0).to(device))
    finally:
        model.train(was_training)
    if logits.dim() != 2:
        raise InputError(f"the model returned logits of shape {tuple(logits.shape)}; expected (N, C)")
    return logits.shape[-1]


def check_classes(
    dataset: Dataset, num_classes: int, root: str | os.PathLike | None = None, reference: Sequence[str] | None = None
) -> None:
    """Refuse a labelled folder whose classes do not match the model's head (or another folder's classes).

    Example:
        >>> check_classes(val, num_classes=1000, root="imagenet/val", reference=train.classes)  # doctest: +SKIP
    """
    classes = list(getattr(dataset, "classes", []))
    where = root or getattr(dataset, "root", "the image folder")
    shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
    if len(classes) != num_classes:
        raise InputError(
            f"{where} has {len(classes)} class folders ({shown}) but the model's head outputs {num_classes} "
            "classes. Use a folder with one sub-folder per class of the model, named so that they sort in "
            "the model's class order (ImageNet: the 1000 wnid folders), or build the model with "
            f"--num-classes {len(classes)} and load your fine-tuned checkpoint"
        )
    if reference is not None and list(reference) != classes:
        differ = sorted(set(classes) ^ set(reference))[:8]
        raise InputError(
            f"{where} has different class folders from the training folder (differing: {differ or 'the order'}); "
            "every labelled folder must hold the same class sub-folders"
        )


def loader(
    dataset: Dataset,
    *,
    batch_size: int = 64,
    workers: int = 0,
    shuffle: bool = False,
    seed: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A ``DataLoader`` over an image dataset (seeded when shuffled).

    Example:
        >>> train_loader = loader(train, batch_size=128, workers=8, shuffle=True)  # doctest: +SKIP
    """
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=False,
    )
