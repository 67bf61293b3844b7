"""Retrofit uncertainty onto a torchvision segmentation network, and bound the object pixels its mask misses.

Run it on a machine with internet (or a filled torch hub cache) and Pascal VOC 2012 on disk
(``VOCdevkit/VOC2012/{JPEGImages,SegmentationClass,ImageSets}``; nothing is downloaded)::

    python recipes/segmentation_torchvision.py --model lraspp_mobilenet_v3_large --voc /data/voc \\
        --train-subset 500 --val-subset 400 --test-subset 600 --size 320 \\
        --method none --method temperature --alpha 0.1 --out reports/lraspp

Offline, ``--random`` builds the same architecture with random weights (``weights=None, weights_backbone=None``,
3 classes), trains it for ``--train-steps`` steps on tiny synthetic scenes (coloured rectangles and discs on a
noisy background, 32x32) and runs everything else the same way; the test suite runs it so.

Steps: (1) ``torchvision.models.get_model(NAME, weights="DEFAULT")`` (COCO images with the 21 VOC labels), its
``{"out": logits}`` output taken by :class:`SegmentationLogits`, so posthoc sees logits ``(N, C, H, W)``;
(2) VOC images and masks resized to ``--size`` (masks by nearest neighbour; 255 marks the object borders VOC leaves
unlabelled, and posthoc ignores them), normalised with ImageNet's mean and std as the weights expect;
(3) ``posthoc.wrap(model, method=..., dense=True).fit(train, val)`` for each ``--method`` (every pixel an example,
255 ignored), and ``posthoc.evaluate`` on the test images: per-pixel NLL, ECE, Brier, accuracy, mIoU and the
entropy's AUROC for errors; (4) conformal risk control on the validation images, for each method's predictive:
``posthoc.risk_control`` picks the threshold on ``P(foreground) = 1 - P(background)`` whose mask misses at most
``--alpha`` of an image's object pixels in expectation, and the test images' miss rate (FNR) is reported beside it;
(5) ``report.md`` and ``metrics.json`` in ``--out``.

The validation images both fit the methods (a temperature: one number) and calibrate the risk control; for the
guarantee to hold exactly, pass ``--risk-subset K`` to keep K of them for the risk control only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

import posthoc
from posthoc.errors import exit_status
from posthoc.evaluation.dense import DenseReport

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IGNORE_INDEX = 255


class SegmentationLogits(nn.Module):
    """A torchvision segmentation model (``forward`` returns ``{"out": ..., "aux": ...}``) as a module of logits
    ``(N, C, H, W)``: the main head's output, at the input's resolution."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)["out"]


def load_model(name: str, random: bool, num_classes: int) -> nn.Module:
    """``torchvision.models.get_model(name, weights="DEFAULT")``, or random weights (backbone too) when ``random``."""
    if random:
        net = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=num_classes)
    else:
        net = torchvision.models.get_model(name, weights="DEFAULT")
    return SegmentationLogits(net).eval()


def synthetic_scenes(count: int, *, size: int = 32, num_classes: int = 3, seed: int = 0) -> TensorDataset:
    """``count`` noisy images ``(3, size, size)`` with one shape per class present (rectangles for odd classes,
    discs for even ones, each class its own colour) and their masks ``(size, size)``: background 0, an unlabelled
    (255) one-pixel border around each shape, as VOC marks object borders."""
    g = torch.Generator().manual_seed(seed)
    colours = torch.rand(num_classes, 3, generator=g)
    images = 0.5 + 0.15 * torch.randn(count, 3, size, size, generator=g)
    masks = torch.zeros(count, size, size, dtype=torch.long)
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(count):
        for cls in range(1, num_classes):
            if torch.rand(1, generator=g) < 0.35:
                continue
            cy, cx = torch.randint(4, size - 4, (2,), generator=g).tolist()
            r = int(torch.randint(3, max(4, size // 4), (1,), generator=g))
            if cls % 2:
                inside = ((rows - cy).abs() <= r) & ((cols - cx).abs() <= r // 2 + 1)
            else:
                inside = (rows - cy) ** 2 + (cols - cx) ** 2 <= r * r
            border = F.max_pool2d(inside[None, None].float(), 3, 1, 1)[0, 0].bool() & ~inside
            images[i][:, inside] = colours[cls][:, None] + 0.15 * torch.randn(3, int(inside.sum()), generator=g)
            masks[i][border & (masks[i] == 0)] = IGNORE_INDEX
            masks[i][inside] = cls
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    return TensorDataset((images.clamp(0, 1) - mean) / std, masks)


class ResizedVOC(torch.utils.data.Dataset):
    """Pascal VOC segmentation (already on disk) as ``(image (3, size, size), mask (size, size))`` tensors."""

    def __init__(self, root: str, image_set: str, size: int) -> None:
        self.voc = torchvision.datasets.VOCSegmentation(root, year="2012", image_set=image_set, download=False)
        self.size = size

    def __len__(self) -> int:
        return len(self.voc)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        from torchvision.transforms.v2 import functional as TF  # noqa: N812

        image, mask = self.voc[index]
        image = TF.resize(TF.to_image(image), [self.size, self.size], antialias=True)
        mask = TF.resize(TF.to_image(mask), [self.size, self.size], interpolation=TF.InterpolationMode.NEAREST)
        image = TF.normalize(TF.to_dtype(image, torch.float32, scale=True), IMAGENET_MEAN, IMAGENET_STD)
        return image, mask[0].long()


def subset(dataset: Any, count: int | None, seed: int) -> Any:
    """The first ``count`` of a fixed random permutation of ``dataset`` (all of it when ``count`` is ``None``)."""
    if count is None or count >= len(dataset):
        return dataset
    return Subset(dataset, torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:count].tolist())


def train_briefly(model: nn.Module, loader: Iterable, steps: int, lr: float = 3e-3) -> nn.Module:
    """``steps`` Adam steps of per-pixel cross-entropy (255 ignored): random weights learn the synthetic scenes."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    step = 0
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y, ignore_index=IGNORE_INDEX)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
    return model.eval()


@torch.no_grad()
def foreground(um: Any, loader: Iterable) -> tuple[Tensor, Tensor]:
    """Each image's ``P(foreground) = 1 - P(background)`` map under ``um``'s predictive and its class mask, batch by
    batch (the full ``(N, C, H, W)`` probabilities of a whole split need not fit in memory)."""
    scores, masks = [], []
    for x, y in loader:
        scores.append(1.0 - um.predict(x).probs[:, 0])
        masks.append(y)
    return torch.cat(scores), torch.cat(masks)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="lraspp_mobilenet_v3_large", help="a torchvision.models.segmentation name")
    p.add_argument("--voc", help="Pascal VOC root (holding VOCdevkit/); with --random: not needed")
    p.add_argument("--random", action="store_true", help="random weights and synthetic scenes: runs offline")
    p.add_argument("--num-classes", type=int, default=3, help="classes of the --random model (background 0)")
    p.add_argument("--train-steps", type=int, default=60, help="--random: training steps on the synthetic scenes")
    p.add_argument("--train-subset", type=int, default=None)
    p.add_argument("--val-subset", type=int, default=None)
    p.add_argument("--test-subset", type=int, default=None)
    p.add_argument("--size", type=int, default=320, help="VOC images and masks are resized to size x size")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--method", action="append", help="posthoc method (repeatable); default: none, temperature, auto")
    p.add_argument("--alpha", type=float, default=0.1, help="risk control: expected missed foreground fraction")
    p.add_argument("--risk-subset", type=int, default=None, help="validation images kept for the risk control only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("reports/segmentation"))
    return p


def datasets(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Train, validation (calibration) and test sets: synthetic scenes with ``--random``, else VOC's train and val
    (VOC's val split in half: calibration and test)."""
    if args.random:
        return tuple(
            synthetic_scenes(count, num_classes=args.num_classes, seed=args.seed + k)
            for k, count in enumerate((args.train_subset or 96, args.val_subset or 64, args.test_subset or 64))
        )
    if args.voc is None:
        raise posthoc.InputError("pass --voc ROOT (Pascal VOC 2012 on disk) or --random (offline, synthetic scenes)")
    train = subset(ResizedVOC(args.voc, "train", args.size), args.train_subset, args.seed)
    val = ResizedVOC(args.voc, "val", args.size)
    order = torch.randperm(len(val), generator=torch.Generator().manual_seed(args.seed)).tolist()
    half = len(order) // 2
    calibration = subset(Subset(val, order[:half]), args.val_subset, args.seed)
    return train, calibration, subset(Subset(val, order[half:]), args.test_subset, args.seed)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole recipe; returns what it writes to ``metrics.json``."""
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train, val, test = datasets(args)
    loader = lambda data, shuffle=False: DataLoader(data, batch_size=args.batch_size, shuffle=shuffle)  # noqa: E731
    model = load_model(args.model, args.random, args.num_classes)
    if args.random:
        train_briefly(model, loader(train, shuffle=True), args.train_steps)

    fit_val, risk_val = val, val
    if args.risk_subset:
        fit_val, risk_val = Subset(val, range(args.risk_subset, len(val))), Subset(val, range(args.risk_subset))

    tables, metrics = [], {}
    for method in args.method or ["none", "temperature", "auto"]:
        um = posthoc.wrap(model, method=method, dense=True).fit(loader(train), loader(fit_val), progress=False)
        table = posthoc.evaluate(um, loader(test), name=method)  # a DenseReport: per-pixel metrics, 255 ignored
        val_scores, val_masks = foreground(um, loader(risk_val))
        test_scores, test_masks = foreground(um, loader(test))
        valid = (val_masks != IGNORE_INDEX, test_masks != IGNORE_INDEX)
        # binary targets: 1 on the object, 0 on the background, 255 unlabelled
        val_targets = torch.where(valid[0], (val_masks != 0).long(), IGNORE_INDEX)
        test_targets = torch.where(valid[1], (test_masks != 0).long(), IGNORE_INDEX)
        rc = posthoc.risk_control(val_scores, val_targets, alpha=args.alpha)
        risk = {
            "alpha": args.alpha,
            "threshold": rc.threshold if math.isfinite(rc.threshold) else None,
            "calibration_bound": rc.bound,
            "test_fnr": float(rc.risk(test_scores, test_targets).mean()),
            "test_mask_fraction": float(rc.mask(test_scores)[valid[1]].float().mean()),
        }
        tables.append(table)
        metrics[method] = {**table.rows[method], "risk_control": risk}
        print(
            f"{method}: per-pixel NLL {table.rows[method]['NLL']:.4f}, accuracy {table.rows[method]['accuracy']:.4f}; "
            f"risk control at alpha={args.alpha}: test FNR {risk['test_fnr']:.3f} (threshold {rc.threshold:.4g} on "
            f"P(foreground), the mask holds {risk['test_mask_fraction']:.1%} of the pixels)"
        )
    combined = DenseReport(rows={name: row for table in tables for name, row in table.rows.items()})
    fnr = "\n".join(f"| {name} | {m['risk_control']['test_fnr']:.4f} | {args.alpha:g} |" for name, m in metrics.items())
    report = (
        f"# {args.model}: per-pixel metrics on {len(test)} test images ({tables[0].positions:,} labelled pixels)\n\n"
        + combined.to_markdown()
        + f"\n\n## Risk control of the foreground mask\n\n| method | test FNR | alpha |\n|---|---|---|\n{fnr}\n"
    )
    (args.out / "report.md").write_text(report)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"wrote {args.out / 'report.md'} and {args.out / 'metrics.json'}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
