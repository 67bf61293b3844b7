"""Train a LightningModule, fit posthoc when training ends, and restore the fitted model from the checkpoint.

A small classifier of scikit-learn's 8x8 digits (1,797 images, bundled with scikit-learn: nothing to download)
is trained for a few epochs with ``lightning``; :class:`posthoc_apps.lightning.PosthocCallback` then fits the
post-hoc method on the best checkpoint's network, with the datamodule's training and validation loaders::

    python recipes/lightning_callback.py --out reports/lightning --epochs 2 --method laplace+temperature

It writes to ``--out``: ``checkpoints/`` (Lightning's best checkpoint and, beside it, the posterior
``<checkpoint>.posthoc.pt``), ``report.md`` (accuracy, NLL, ECE, Brier, AURC of the plain network and of the
wrapped one on the test digits) and ``restore.json`` (the checkpoint, the posterior file, and the largest
difference between the callback's probabilities and those of the model restored from the two files).

In your own project the callback is one line, and restoring two::

    from posthoc_apps.lightning import PosthocCallback

    callback = PosthocCallback(method=["laplace", "temperature"], model_attr="net")
    trainer = lightning.Trainer(max_epochs=10, callbacks=[callback])
    trainer.fit(module, datamodule=datamodule)
    callback.uncertain_model.predict(x)          # the fitted posthoc.UncertainModel

    module = LitClassifier.load_from_checkpoint(callback.checkpoint_path)        # later, anywhere
    um = posthoc.load(PosthocCallback.posterior_path_for(callback.checkpoint_path), module.net)

(``PosthocCallback.restore(checkpoint_path, LitClassifier, model_attr="net")`` does both.) The network is the
attribute ``model_attr`` names; without it, the module itself if its class defines ``forward(x) -> logits``,
else its only child module with parameters. ``on="validate"`` fits when ``trainer.validate`` ends instead (pass
``ckpt_path=`` there to save the posterior beside that checkpoint). Needs ``pip install 'posthoc[lightning]'``.
The recipe's file: recipes/lightning_callback.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import exit_status
from posthoc.evaluation.report import markdown_table
from posthoc_apps.lightning import PosthocCallback


class LitDigits(pl.LightningModule):
    """An MLP on the 64 pixels of an 8x8 digit, trained with Adam; the network is ``self.net``."""

    def __init__(self, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class DigitsData(pl.LightningDataModule):
    """scikit-learn's digits scaled to [0, 1], split with a fixed seed: ``train`` examples to train on, ``val``
    held out (posthoc's held-out choices), the rest to test."""

    def __init__(self, train: int = 1000, val: int = 400, batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        x, y = load_digits(return_X_y=True)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        x = torch.as_tensor(x, dtype=torch.float32)[order] / 16.0
        y = torch.as_tensor(y, dtype=torch.long)[order]
        self.splits = {
            "train": (x[:train], y[:train]),
            "val": (x[train : train + val], y[train : train + val]),
            "test": (x[train + val :], y[train + val :]),
        }
        self.batch_size = batch_size

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        return DataLoader(TensorDataset(*self.splits[split]), batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.loader("test")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    parser.add_argument(
        "--method",
        default="laplace+temperature",
        help="the posthoc method, methods joined by '+' to compose them (default laplace+temperature)",
    )
    parser.add_argument("--epochs", type=int, default=5, help="training epochs (default 5)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and of the training")
    parser.add_argument(
        "--no-shift",
        action="store_true",
        help="make posthoc's held-out choices on the clean validation batches only, without perturbed "
        "copies (faster; fit_options={'shift': None})",
    )
    parser.add_argument("--progress", action="store_true", help="show Lightning's and posthoc's progress bars")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Train, fit, restore and evaluate; write the outputs and return what ``restore.json`` holds."""
    pl.seed_everything(args.seed, verbose=False)
    data = DigitsData(batch_size=args.batch_size, seed=args.seed)
    module = LitDigits()
    callback = PosthocCallback(
        method=args.method.split("+"), model_attr="net", fit_options={"shift": None} if args.no_shift else None
    )
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=args.out / "checkpoints", monitor="val_loss", mode="min")
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[checkpoints, callback],
        default_root_dir=args.out,
        enable_progress_bar=args.progress,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)

    restored = PosthocCallback.restore(callback.checkpoint_path, LitDigits, model_attr="net")
    x_test = data.splits["test"][0]
    difference = (restored.predict(x_test).probs - callback.uncertain_model.predict(x_test).probs).abs().max()
    plain = posthoc.wrap(LitDigits.load_from_checkpoint(callback.checkpoint_path).net, method="none")
    reports = [
        posthoc.evaluate(plain, data.test_dataloader(), name="plain network", progress=args.progress),
        posthoc.evaluate(restored, data.test_dataloader(), name=args.method, progress=args.progress),
    ]
    (args.out / "report.md").write_text(
        "\n".join(
            [
                f"# {args.method} fitted by PosthocCallback after {args.epochs} epochs",
                "",
                f"- checkpoint: {callback.checkpoint_path}",
                f"- posterior: {callback.posterior_path}",
                f"- test digits: {len(x_test)}",
                "",
                markdown_table(reports),
                "",
            ]
        )
    )
    summary = {
        "checkpoint": str(callback.checkpoint_path),
        "posterior": str(callback.posterior_path),
        "max_abs_difference": float(difference),
        "test": {r.name: r.as_dict() for r in reports},
    }
    (args.out / "restore.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{args.method}: NLL {reports[0].nll:.4f} -> {reports[1].nll:.4f}, ECE {reports[0].ece:.4f} -> "
        f"{reports[1].ece:.4f}; restored from {callback.posterior_path} (max |difference| {float(difference):.1e})"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
