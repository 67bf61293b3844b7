"""The project's own small pretrained checkpoint, and the seeded script that trains it.

``digits_cnn`` is a small CNN (conv–BN–ReLU ×2, then a dropout MLP head) trained on the fit
split of the bundled digits. The demo retrofits uncertainty onto it like onto any production
checkpoint. Rebuild the shipped file with::

    python -m posthoc.demo.zoo --out posthoc/demo/checkpoints/digits_cnn.pt --seed 0

Example:
    >>> model = pretrained("digits_cnn")
    >>> model(torch.zeros(1, 1, 28, 28)).shape
    torch.Size([1, 8])
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from posthoc.demo import data

CHECKPOINTS = Path(__file__).parent / "checkpoints"


class DigitsCNN(nn.Module):
    """A LeNet-sized CNN with BatchNorm and a dropout head, laid out like torchvision models."""

    def __init__(self, num_classes: int = 8, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def train(seed: int = 0, epochs: int = 12, lr: float = 1e-3, progress: bool = True) -> DigitsCNN:
    """Train :class:`DigitsCNN` on the fit split with Adam; deterministic for a given seed on CPU."""
    torch.manual_seed(seed)
    splits = data.load_digits()
    model = DigitsCNN(splits.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train_loader = data.loader(splits.fit, batch_size=64, shuffle=True, seed=seed)
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
            print(f"epoch {epoch + 1}/{epochs}: train loss {total / len(splits.fit):.4f}")
    return model.eval()


def pretrained(name: str = "digits_cnn") -> nn.Module:
    """Load a checkpoint shipped with posthoc (``weights_only``), in eval mode."""
    path = CHECKPOINTS / f"{name}.pt"
    if name != "digits_cnn" or not path.exists():
        available = sorted(p.stem for p in CHECKPOINTS.glob("*.pt"))
        raise FileNotFoundError(f"no bundled checkpoint '{name}'; available: {available}")
    model = DigitsCNN()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the bundled digits CNN checkpoint.")
    parser.add_argument("--out", type=Path, default=CHECKPOINTS / "digits_cnn.pt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args(argv)
    model = train(args.seed, args.epochs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
