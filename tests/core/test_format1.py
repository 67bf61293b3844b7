"""Posterior files written before the package moved into core/engine/methods still load and predict the same."""

import importlib.util
from pathlib import Path

import pytest
import torch

import posthoc
from posthoc.errors import PosteriorFileError

FIXTURES = Path(__file__).parent / "data" / "format1"
_spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
MAKER = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MAKER)  # the model, data and configurations the files were made from


@pytest.mark.parametrize("name", sorted(MAKER.CONFIGS))
def test_a_format1_file_loads_and_predicts_as_when_it_was_saved(name):
    um = posthoc.load(FIXTURES / f"{name}.pt", MAKER.model())
    _, x = MAKER.data()
    expected = torch.load(FIXTURES / f"{name}.expected.pt", weights_only=True)
    probs = um.predict(x, generator=torch.Generator().manual_seed(0)).probs
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=0)


def test_a_format1_file_refuses_another_model():
    other = MAKER.model()
    with torch.no_grad():
        other[-1].bias.add_(1.0)
    with pytest.raises(PosteriorFileError, match="different model"):
        posthoc.load(FIXTURES / "laplace-kron.pt", other)
