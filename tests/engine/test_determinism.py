"""The same seed gives the same predictions, for every method, in two separate processes."""

import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent("""
    import sys, torch, posthoc
    from torch import nn
    torch.set_num_threads(1)  # tiny fits: more threads only fight over a busy CPU (the same results either way)
    from torch.utils.data import DataLoader, TensorDataset
    fast_fit = {"swag": {"epochs": 1}, "ibnn": {"epochs": 1}, "abnn": {"epochs": 1}}
    # calibrators that refuse this toy set by design: per-class parameters need 5-10 examples of every
    # class (class 2 has 4 here), and platt calibrates binary classifiers only
    refuse_toy_set = {"vector", "matrix", "dirichlet", "histogram", "isotonic", "platt"}
    results = {}
    for method in sorted(set(posthoc.available_methods()) - refuse_toy_set):
        torch.manual_seed(0)
        norm = [nn.BatchNorm1d(16)] if method in ("mc-batchnorm", "abnn") else []  # they need BatchNorm
        model = nn.Sequential(nn.Linear(4, 16), *norm, nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
        x = torch.randn(96, 4)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
        loader = DataLoader(TensorDataset(x, y), batch_size=32)
        um = posthoc.wrap(model, method=method).fit(loader, loader, progress=False, **fast_fit.get(method, {}))
        results[method] = um.predict(x[:10], generator=torch.Generator().manual_seed(1)).probs
    torch.save(results, sys.argv[1])
""")


def test_same_seed_same_predictions_across_processes(tmp_path):
    paths = [tmp_path / f"run{i}.pt" for i in range(2)]
    for path in paths:
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    first, second = (torch.load(p, weights_only=True) for p in paths)
    assert first.keys() == second.keys() and "temperature" in first
    for method in first:
        assert torch.equal(first[method], second[method]), method
