import pytest
import torch
from torch import nn

from posthoc.core.modules import eval_mode
from posthoc.engine.head import FeatureSplit, find_head
from posthoc.errors import HeadNotFoundError


def test_split_reproduces_logits_exactly(architecture):
    name, model, x = architecture
    split = FeatureSplit(model)
    phi, logits = split(x)
    with torch.no_grad():
        assert torch.equal(split.head(phi), model(x)), name
    assert phi.shape == (x.shape[0], split.head.in_features)


def test_plain_module_head_found_by_tracing():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(8, 3)  # registered first, called last
            self.body = nn.Linear(4, 8)

        def forward(self, x):
            return self.out(torch.relu(self.body(x)))

    split = FeatureSplit(Net())
    assert split.head is None  # resolved lazily, on the first input
    phi, logits = split(torch.randn(5, 4))
    assert split.head_name == "out" and phi.shape == (5, 8)


def test_user_named_head_and_unknown_name():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    assert find_head(model, "0")[0] == "0"
    with pytest.raises(HeadNotFoundError, match="no module named 'nope'.*available"):
        find_head(model, "nope")


def test_model_without_head_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(HeadNotFoundError, match="could not find the classifier head"):
        FeatureSplit(model)(torch.randn(2, 3, 4, 4))


def test_head_whose_output_is_transformed_is_refused():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x) * 2

    with pytest.raises(HeadNotFoundError, match="not the model's output"):
        FeatureSplit(Scaled())(torch.randn(2, 4))


def test_non_linear_head_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 5, 1), nn.Flatten())
    with pytest.raises(HeadNotFoundError, match="not nn.Linear"):
        FeatureSplit(model, head="0")


def test_eval_mode_restores_each_flag():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Dropout())
    model.train()
    model[1].eval()
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and model[0].training and not model[1].training
