"""``posthoc_apps.lightning.PosthocCallback``: two-epoch fits of a small LightningModule on scikit-learn's digits (CPU).

The module and datamodule are the recipe's (``recipes/lightning_callback.py``), so the recipe's code is what is
tested; the recipe itself also runs end to end here.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import posthoc
from posthoc_apps.lightning import PosthocCallback, network_of

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "lightning_callback.py"
spec = importlib.util.spec_from_file_location("recipe_lightning_callback", RECIPE)
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)

#: the same weights and the same posterior tensors through the same CPU ops: equal up to float rounding
SAME_MODEL_ATOL = 1e-6

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


class EpochZeroBest(recipe.LitDigits):
    """Logs the epoch as the monitored metric, so that ``mode="min"`` keeps epoch 0 as the best checkpoint while
    training goes on: the trained weights and the best checkpoint's differ. It defines ``forward``, so the
    network posthoc wraps is the module itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("epoch_index", float(self.current_epoch))


class TwoNetworks(recipe.LitDigits):
    """No forward and two modules with parameters: which one is the network is ambiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(64, 1)


class WithForward(recipe.LitDigits):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TrainOnly(pl.LightningDataModule):
    """A datamodule with training data only."""

    def __init__(self) -> None:
        super().__init__()
        self.data = recipe.DigitsData()

    def train_dataloader(self) -> DataLoader:
        return self.data.train_dataloader()


@pytest.fixture(scope="module")
def data() -> recipe.DigitsData:
    return recipe.DigitsData(train=400, val=200)


def _trainer(root: Path, callbacks: list, **kwargs) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    settings = {
        "max_epochs": 2,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return pl.Trainer(default_root_dir=root, callbacks=callbacks, **settings)


def test_fit_on_the_best_checkpoint_saves_beside_it_and_restores(data: recipe.DigitsData, tmp_path: Path) -> None:
    # the network: the module itself (it defines forward); no perturbed copies of the held-out data (faster)
    callback = PosthocCallback(method=["laplace", "temperature"], fit_options={"shift": None})
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="epoch_index", mode="min", save_top_k=-1
    )
    module = EpochZeroBest()
    _trainer(tmp_path, [callback, checkpoints]).fit(module, datamodule=data)

    best = Path(checkpoints.best_model_path)
    assert best.name.startswith("epoch=0") and callback.checkpoint_path == best
    assert callback.posterior_path == best.with_suffix(".posthoc.pt") and callback.posterior_path.is_file()
    um = callback.uncertain_model
    assert um.is_fitted and um.methods == ["laplace", "temperature"]
    assert (um.fit_record.train_examples, um.fit_record.val_examples) == (400, 200)  # the datamodule's loaders
    assert type(um.method.base_model) is EpochZeroBest and um.method.base_model is not module  # epoch 0's copy
    assert um.method.base_model._trainer is None  # the copy left the trainer behind

    x = data.splits["test"][0]
    restored = PosthocCallback.restore(best, EpochZeroBest)
    torch.testing.assert_close(restored.predict(x).probs, um.predict(x).probs, atol=SAME_MODEL_ATOL, rtol=0)
    # the two-line route is the same
    net = EpochZeroBest.load_from_checkpoint(best)
    by_hand = posthoc.load(PosthocCallback.posterior_path_for(best), net)
    torch.testing.assert_close(by_hand.predict(x).probs, um.predict(x).probs, atol=SAME_MODEL_ATOL, rtol=0)

    # the posterior belongs to epoch 0's weights: not to the trained ones, not to epoch 1's checkpoint
    with pytest.raises(posthoc.PosteriorFileError, match="different model"):
        posthoc.load(callback.posterior_path, module)
    last = next(path for path in (tmp_path / "ckpt").glob("epoch=1*.ckpt"))
    with pytest.raises(posthoc.PosteriorFileError, match="different model"):
        PosthocCallback.restore(last, EpochZeroBest, posterior_path=callback.posterior_path)
    with pytest.raises(posthoc.PosteriorFileError, match="no posterior file at .*epoch=1.*posthoc.pt"):
        PosthocCallback.restore(last, EpochZeroBest)  # no posterior beside epoch 1's checkpoint

    # oracle: posthoc.wrap on the checkpoint's network with the datamodule's loaders, by hand
    manual = posthoc.wrap(net, method=["laplace", "temperature"]).fit(
        data.train_dataloader(), data.val_dataloader(), progress=False, shift=None
    )
    # the training loader is shuffled, so the curvature sums in another order: float32 rounding only
    torch.testing.assert_close(manual.predict(x).probs, um.predict(x).probs, atol=1e-4, rtol=0)


def test_without_a_checkpoint_then_on_validate(data: recipe.DigitsData, tmp_path: Path) -> None:
    """No checkpoint: the trained weights, saved in default_root_dir. Then ``on="validate"`` with ``ckpt_path``,
    whose hooks Lightning runs under inference mode (the posterior's tensors must stay ordinary ones, and
    temperature's fit needs gradients)."""
    callback = PosthocCallback(method="laplace", model_attr="net", prior_precision=1.0)  # a fixed prior: no choice
    module = recipe.LitDigits()
    trainer = _trainer(tmp_path, [callback], enable_checkpointing=False)
    trainer.fit(module, datamodule=data)
    assert callback.checkpoint_path is None and callback.posterior_path == tmp_path / "posthoc.pt"
    x = data.splits["test"][0]
    loaded = posthoc.load(tmp_path / "posthoc.pt", module.net)
    torch.testing.assert_close(
        loaded.predict(x).probs, callback.uncertain_model.predict(x).probs, atol=SAME_MODEL_ATOL, rtol=0
    )

    checkpoint = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(checkpoint)
    on_validate = PosthocCallback(method="temperature", model_attr="net", on="validate", fit_options={"shift": None})
    validator = _trainer(tmp_path / "validate", [on_validate])
    validator.validate(recipe.LitDigits(), datamodule=data, ckpt_path=checkpoint)
    assert on_validate.checkpoint_path == checkpoint and on_validate.posterior_path == tmp_path / "saved.posthoc.pt"
    assert on_validate.uncertain_model.fit_record.val_examples == 200
    restored = PosthocCallback.restore(checkpoint, recipe.LitDigits, model_attr="net")
    torch.testing.assert_close(
        restored.predict(x).probs, on_validate.uncertain_model.predict(x).probs, atol=SAME_MODEL_ATOL, rtol=0
    )
    # a validate-only callback does not fit during trainer.fit
    idle = PosthocCallback(method="temperature", model_attr="net", on="validate")
    idle_trainer = _trainer(tmp_path / "idle", [idle], max_epochs=1, enable_checkpointing=False)
    idle_trainer.fit(recipe.LitDigits(), datamodule=data)
    assert idle.uncertain_model is None and not (tmp_path / "idle" / "posthoc.pt").exists()


# ------------------------------------------------------------------------------------------ refusals


def test_names_and_options_are_refused_when_the_callback_is_built() -> None:
    with pytest.raises(posthoc.ConfigError, match="unknown method 'lapalce'.*laplace"):
        PosthocCallback(method="lapalce")
    with pytest.raises(posthoc.ConfigError, match=r"unknown option\(s\) \['hesian'\].*hessian="):
        PosthocCallback(method="laplace", hesian="kron")
    with pytest.raises(posthoc.ConfigError, match=r"unknown fit option\(s\) \['epochs'\]"):
        PosthocCallback(method="laplace", fit_options={"epochs": 3})
    with pytest.raises(posthoc.ConfigError, match="fit, validate"):
        PosthocCallback(method="laplace", on="test")
    assert PosthocCallback(method="swag", fit_options={"epochs": 1}).fit_options == {"epochs": 1}


def test_a_held_out_method_without_a_validation_loader_is_refused_before_training(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [PosthocCallback(method=["laplace", "temperature"])])
    with pytest.raises(posthoc.InputError, match="laplace\\+temperature is fitted on held-out data.*val_dataloader"):
        trainer.fit(recipe.LitDigits(), datamodule=TrainOnly())
    assert trainer.global_step == 0  # refused at setup, before any training step


def test_the_network_must_be_found(data: recipe.DigitsData, tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [PosthocCallback(method="laplace", model_attr="backbone")])
    with pytest.raises(posthoc.ConfigError, match="no module 'backbone'.*its modules: net"):
        trainer.fit(recipe.LitDigits(), datamodule=data)
    assert trainer.global_step == 0
    trainer = _trainer(tmp_path, [PosthocCallback(method="laplace")])
    with pytest.raises(posthoc.ConfigError, match=r"holds 2 \(net, aux\).*model_attr='net'"):
        trainer.fit(TwoNetworks(), datamodule=data)
    assert trainer.global_step == 0
    with_forward, only_child = WithForward(), recipe.LitDigits()
    assert network_of(with_forward) is with_forward and network_of(only_child) is only_child.net
    assert network_of(TwoNetworks(), "aux").out_features == 1


# ------------------------------------------------------------------------------------------ the optional extra


@pytest.mark.slow  # a fresh interpreter imports posthoc: seconds
def test_importing_posthoc_does_not_import_lightning_and_without_it_the_error_names_the_extra() -> None:
    script = """
import sys
import posthoc
assert not {"lightning", "pytorch_lightning"} & set(sys.modules), "import posthoc imported lightning"
sys.modules["lightning"] = None  # what the import sees without the extra
try:
    import posthoc_apps.lightning
except posthoc.PosthocError as err:
    assert isinstance(err, ImportError) and "pip install 'posthoc[lightning]'" in str(err), err
else:
    raise AssertionError("import posthoc_apps.lightning without lightning did not fail")
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------------------------------------ the recipe


def test_recipe_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert len(recipe.__doc__) > 500 and "recipes/lightning_callback.py" in recipe.__doc__
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--help"])
    assert exit_info.value.code == 0 and "--out" in capsys.readouterr().out
    assert recipe.main(["--out", str(tmp_path), "--epochs", "2", "--method", "laplace", "--no-shift"]) == 0
    summary = json.loads((tmp_path / "restore.json").read_text())
    assert summary["max_abs_difference"] <= SAME_MODEL_ATOL
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.parent == tmp_path / "checkpoints" and Path(summary["posterior"]).is_file()
    assert set(summary["test"]) == {"plain network", "laplace"}
    assert summary["test"]["laplace"]["accuracy"] > 0.5  # 2 epochs of a 10-class MLP are well above chance (0.1)
    report = (tmp_path / "report.md").read_text()
    assert "| plain network |" in report.replace("**", "") and "| laplace |" in report.replace("**", "")
