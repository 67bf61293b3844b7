"""The project's own small pretrained checkpoints, and the seeded script that trains them.

- ``digits_cnn``: a small CNN (conv–BN–ReLU ×2, then a dropout MLP head) trained on the fit split
  of the bundled digits. The demo retrofits uncertainty onto it like onto any production checkpoint.
- ``digits_bn_cnn``: a second architecture without any dropout, laid out like a ResNet (conv–BN–ReLU
  ×3, global average pooling, one linear head), trained on only 1,000 fit images (about 96.5% accurate):
  the case of a model with no dropout to reuse and little data behind it.

Rebuild the shipped files with::

    python -m posthoc_apps.demo.zoo --name digits_cnn --seed 0
    python -m posthoc_apps.demo.zoo --name digits_bn_cnn --seed 0

A few seeds of one architecture (members of a deep ensemble) are trained once and cached as files
(``~/.cache/posthoc/zoo``, or ``$POSTHOC_CACHE/zoo``)::

    python -m posthoc_apps.demo.zoo --name digits_cnn --seeds 0 1 2 3 4
    >>> ensemble = posthoc.wrap(retrained(range(5)))  # trains five CNNs once (minutes)  # doctest: +SKIP

Example:
    >>> import torch
    >>> from posthoc_apps.demo.zoo import pretrained
    >>> model = pretrained("digits_cnn")
    >>> model(torch.zeros(1, 1, 28, 28)).shape
    torch.Size([1, 8])
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from posthoc_apps.demo import data

CHECKPOINTS = Path(__file__).parent / "checkpoints"


def cache_dir() -> Path:
    """Where retrained seeds are cached: ``$POSTHOC_CACHE/zoo``, else ``~/.cache/posthoc/zoo``."""
    return Path(os.environ.get("POSTHOC_CACHE", Path.home() / ".cache" / "posthoc")) / "zoo"


class DigitsCNN(nn.Module):
    """A LeNet-sized CNN with BatchNorm and a dropout head, laid out like torchvision models."""

    def __init__(self, num_classes: int = 8, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 7 * 7, 64),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class DigitsBNCNN(nn.Module):
    """A dropout-free CNN with BatchNorm and global average pooling, laid out like torchvision's ResNets."""

    def __init__(self, num_classes: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


#: name -> (class, training examples taken from the fit split, epochs, Adam learning rate)
ARCHITECTURES: dict[str, tuple[type[nn.Module], int | None, int, float]] = {
    "digits_cnn": (DigitsCNN, None, 12, 1e-3),
    "digits_bn_cnn": (DigitsBNCNN, 1000, 40, 3e-3),
}


def train(
    seed: int = 0, epochs: int | None = None, lr: float | None = None, progress: bool = True, name: str = "digits_cnn"
) -> nn.Module:
    """Train the architecture ``name`` on (part of) the fit split with Adam; deterministic for a given seed on CPU.

    Example:
        >>> model = train(seed=1, name="digits_bn_cnn", progress=False)  # 40 epochs (a minute)  # doctest: +SKIP
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; available: {sorted(ARCHITECTURES)}")
    architecture, examples, default_epochs, default_lr = ARCHITECTURES[name]
    epochs = default_epochs if epochs is None else epochs
    lr = default_lr if lr is None else lr
    torch.manual_seed(seed)
    splits = data.load_digits()
    fit = splits.fit if examples is None else data.subset(splits.fit, examples)
    model = architecture(splits.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train_loader = data.loader(fit, batch_size=64, shuffle=True, seed=seed)
    for epoch in range(epochs):
        model.train()
        total = 0.0
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(y)
        if progress:
            print(f"epoch {epoch + 1}/{epochs}: train loss {total / len(fit):.4f}")
    return model.eval()


def pretrained(name: str = "digits_cnn") -> nn.Module:
    """Load a checkpoint shipped with posthoc (``weights_only``), in eval mode."""
    path = CHECKPOINTS / f"{name}.pt"
    if name not in ARCHITECTURES or not path.exists():
        available = sorted(p.stem for p in CHECKPOINTS.glob("*.pt"))
        raise FileNotFoundError(f"no bundled checkpoint '{name}'; available: {available}")
    model = ARCHITECTURES[name][0]()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def retrained(
    seeds: Iterable[int], name: str = "digits_cnn", *, cache: Path | None = None, progress: bool = False
) -> list[nn.Module]:
    """The architecture ``name`` retrained with each seed (:func:`train`), each trained once and then read
    from ``cache`` (default :func:`cache_dir`) as ``NAME-seedS.pt``: the members of a deep ensemble.

    Example:
        >>> members = retrained([0, 1, 2], name="digits_bn_cnn")  # trains any seed not cached  # doctest: +SKIP
        >>> um = posthoc.wrap(members)  # doctest: +SKIP
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; available: {sorted(ARCHITECTURES)}")
    folder = cache_dir() if cache is None else Path(cache)
    models = []
    for seed in seeds:
        path = folder / f"{name}-seed{seed}.pt"
        if path.exists():
            model = ARCHITECTURES[name][0]()
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            models.append(model.eval())
            continue
        model = train(seed, progress=progress, name=name)
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(model.state_dict(), partial)
        os.replace(partial, path)  # atomic: parallel runs never read a half-written file
        models.append(model)
    return models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a bundled digits checkpoint.")
    parser.add_argument("--name", choices=sorted(ARCHITECTURES), default="digits_cnn")
    parser.add_argument("--out", type=Path, default=None, help="default: posthoc_apps/demo/checkpoints/NAME.pt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=None, help="default: the architecture's own")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help=f"train these seeds into the cache ({cache_dir()}) for ensembles, instead of --out",
    )
    args = parser.parse_args(argv)
    if args.seeds is not None:
        retrained(args.seeds, args.name, progress=True)
        print(f"cached {args.name} seeds {args.seeds} in {cache_dir()}")
        return
    model = train(args.seed, args.epochs, name=args.name)
    args.out = args.out or CHECKPOINTS / f"{args.name}.pt"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
