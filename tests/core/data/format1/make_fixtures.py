"""Posterior files in format 1, written before the architecture move (run: python make_fixtures.py .)."""

import torch
from torch import nn

import posthoc


def model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(4 * 6 * 6, 16),
        nn.ReLU(),
        nn.Linear(16, 5),
    ).eval()


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 1, 8, 8, generator=g)
    y = model()(x).argmax(1)
    y[::7] = (y[::7] + 1) % 5
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=32), x[:16]


CONFIGS = {
    "none": ("none", {}, {}),
    "temperature": ("temperature", {}, {}),
    "laplace-kron": ("laplace", {}, {}),
    "laplace-full": ("laplace", {"hessian": "full"}, {}),
    "laplace-diag-mc": ("laplace", {"hessian": "diag", "link": "mc"}, {}),
    "laplace-subset": ("laplace", {"subset": ["5", "7"]}, {}),
    "laplace-temperature": (["laplace", "temperature"], {}, {}),
    "mc-dropout-auto": ("mc-dropout", {"p": "auto", "num_samples": 8}, {}),
    "swag-last-layer": ("swag", {"subset": "last_layer", "num_samples": 8}, {"epochs": 1}),
    "swag-all": ("swag", {"num_samples": 4}, {"epochs": 1}),
    "ibnn": ("ibnn", {"num_samples": 4}, {"epochs": 1}),
}

if __name__ == "__main__":
    import sys

    out = sys.argv[1]
    loader, x = data()
    for name, (method, options, fit) in CONFIGS.items():
        um = posthoc.wrap(model(), method=method, **options).fit(loader, loader, progress=False, **fit)
        um.save(f"{out}/{name}.pt")
        probs = um.predict(x, generator=torch.Generator().manual_seed(0)).probs
        torch.save(probs, f"{out}/{name}.expected.pt")
        print(name, probs[0])
