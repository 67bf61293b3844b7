"""Bad data at fit: a NaN/inf batch is refused by the shared iteration with its index, whatever the
method; a curvature that is not finite although the inputs are is a NumericalError saying what to try."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import InputError, NumericalError


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)).eval()


def loader(corrupt_row: int | None = None, value: float = float("nan"), n: int = 40, batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)
    if corrupt_row is not None:
        x[corrupt_row, 2] = value
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "options",
    [
        {"method": "laplace"},
        {"method": "laplace", "hessian": "full", "prior_precision": 1.0},
        {"method": "laplace", "hessian": "diag", "prior_precision": "marglik"},
        {"method": "laplace", "subset": "all", "prior_precision": 1.0},
    ],
)
def test_laplace_fit_names_the_batch_with_non_finite_inputs(options: dict, value: float) -> None:
    # row 21 is in batch 2 (rows 16..23) of the training loader; before the check, eigh raised a raw LinAlgError
    with pytest.raises(InputError, match=r"batch 2 \(0-based\) of the loader for 'laplace curvature.*NaN or inf"):
        posthoc.wrap(mlp(), **options).fit(loader(corrupt_row=21, value=value), progress=False)


@pytest.mark.parametrize("shift", [None, "auto"])
def test_laplace_val_loader_is_checked_too(shift) -> None:
    # the held-out loader is read once, before any fit, for every stage and for the shifted copies alike
    with pytest.raises(InputError, match=r"batch 4 \(0-based\) of the loader for 'held-out data'"):
        posthoc.wrap(mlp(), method="laplace", prior_precision="val").fit(
            loader(), loader(corrupt_row=39), progress=False, shift=shift
        )


def test_temperature_and_mc_dropout_fit_name_the_batch() -> None:
    with pytest.raises(InputError, match=r"batch 1 \(0-based\) of the loader for 'held-out data'.*not finite"):
        posthoc.wrap(mlp(), method="temperature").fit(None, loader(corrupt_row=9), progress=False)
    with pytest.raises(InputError, match=r"batch 0 \(0-based\) of the loader for 'held-out data'.*NaN or inf"):
        posthoc.wrap(mlp(), method="mc-dropout", p="auto").fit(loader(), loader(corrupt_row=3), progress=False)


def test_dict_inputs_are_checked_and_integer_tensors_are_not() -> None:
    class DictModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.fc = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.relu(self.body(pixels) + ids[:, :1]))

    x = torch.randn(16, 4)
    ids = torch.zeros(16, 2, dtype=torch.long)
    clean = [
        ({"pixels": x[:8], "ids": ids[:8]}, torch.arange(8) % 3),
        ({"pixels": x[8:], "ids": ids[8:]}, torch.arange(8) % 3),
    ]
    posthoc.wrap(DictModel().eval(), method="laplace", head="fc", prior_precision=1.0).fit(clean, progress=False)
    dirty = [clean[0], ({"pixels": x[8:].clone().fill_(float("nan")), "ids": ids[8:]}, torch.arange(8) % 3)]
    with pytest.raises(InputError, match=r"batch 1 \(0-based\)"):
        posthoc.wrap(DictModel().eval(), method="laplace", head="fc", prior_precision=1.0).fit(dirty, progress=False)


@pytest.mark.parametrize(
    "options",
    [
        {"hessian": "kron"},
        {"hessian": "full"},
        {"hessian": "diag"},
        {"subset": "all", "hessian": "kron"},
    ],
)
def test_a_non_finite_curvature_from_finite_inputs_is_a_numerical_error_that_says_what_to_try(options: dict) -> None:
    model = mlp()
    with torch.no_grad():
        model[0].weight[3, 1] = float("nan")  # a corrupted checkpoint: finite inputs, NaN features
    with pytest.raises(NumericalError, match=r"contains NaN or inf although the inputs are finite.*model.float\(\)"):
        posthoc.wrap(model, method="laplace", prior_precision=1.0, **options).fit(loader(), progress=False)
