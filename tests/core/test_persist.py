import os

import pytest
import torch

import posthoc
from posthoc.core import persistence as persist
from posthoc.errors import PosteriorFileError
from posthoc_apps.demo import zoo


@pytest.fixture()
def fitted(digits_model, loaders):
    return posthoc.wrap(digits_model, method="temperature").fit(val_loader=loaders["calibration"], progress=False)


def test_round_trip_is_bit_exact(fitted, digits_model, digits, tmp_path):
    path = tmp_path / "digits.temperature.pt"
    fitted.save(path)
    loaded = posthoc.load(path, digits_model)
    x = digits.test.tensors[0][:32]
    assert torch.equal(loaded.method.temperature, fitted.method.temperature)
    assert torch.equal(loaded.predict(x).probs, fitted.predict(x).probs)
    assert loaded.methods == ["temperature"] and loaded.is_fitted


def test_file_does_not_hold_the_base_weights(fitted, tmp_path):
    path = tmp_path / "p.pt"
    fitted.save(path)
    state = persist.read(path)["state"]
    assert not any(key.startswith("model.") or ".model." in key for key in state)


def test_refuses_another_model(fitted, tmp_path):
    path = tmp_path / "p.pt"
    fitted.save(path)
    other = zoo.DigitsCNN()
    with pytest.raises(PosteriorFileError, match="different model.*architecture or weights differ"):
        posthoc.load(path, other)


def test_refuses_a_model_changed_by_one_weight(fitted, digits_model, tmp_path):
    path = tmp_path / "p.pt"
    fitted.save(path)
    with torch.no_grad():
        digits_model.classifier[-1].bias[0] += 1e-3
    with pytest.raises(PosteriorFileError, match="different model"):
        posthoc.load(path, digits_model)
    with pytest.raises(PosteriorFileError, match="changed after fit"):
        fitted.save(tmp_path / "q.pt")


def test_refuses_a_pickled_payload(digits_model, tmp_path):
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "spec": [], "fingerprint": "", "state": {}, "x": Exploit()}, path)
    with pytest.raises(PosteriorFileError, match="not plain tensors"):
        posthoc.load(path, digits_model)
    assert not (tmp_path / "pwned").exists()


def test_refuses_a_truncated_file(fitted, digits_model, tmp_path):
    path = tmp_path / "p.pt"
    fitted.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(PosteriorFileError, match="not a readable posterior file"):
        posthoc.load(path, digits_model)


def test_refuses_a_newer_format(fitted, digits_model, tmp_path):
    path = tmp_path / "p.pt"
    fitted.save(path)
    payload = persist.read(path)
    payload["format_version"] = persist.FORMAT_VERSION + 1
    torch.save(payload, path)
    with pytest.raises(PosteriorFileError, match="newer posthoc"):
        posthoc.load(path, digits_model)


def test_missing_file_and_unfitted_save(digits_model, tmp_path):
    with pytest.raises(PosteriorFileError, match="no posterior file"):
        posthoc.load(tmp_path / "missing.pt", digits_model)
    with pytest.raises(posthoc.NotFittedError):
        posthoc.wrap(digits_model, method="temperature").save(tmp_path / "x.pt")


def test_write_is_atomic(fitted, tmp_path, monkeypatch):
    path = tmp_path / "p.pt"
    fitted.save(path)
    original = path.read_bytes()

    def broken_save(obj, stream):
        stream.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(PosteriorFileError, match="cannot save to .*disk full.*any file that was there is unchanged"):
        fitted.save(path)
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["p.pt"]


def test_fingerprint_sees_dtype_and_values():
    model = torch.nn.Linear(3, 2)
    assert persist.fingerprint(model) == persist.fingerprint(model)
    assert persist.fingerprint(model) != persist.fingerprint(torch.nn.Linear(3, 2))
    assert persist.fingerprint(model) != persist.fingerprint(model.to(torch.float64))


def test_a_method_without_fit_saves_unfitted_and_still_refuses_changed_weights(tmp_path):
    """A deep ensemble (method "none") needs no fit: it saves as wrapped and loads onto its members only; a member
    changed in place after wrapping is still refused, by the member check of load."""
    torch.manual_seed(0)
    members = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    posthoc.wrap(members).save(tmp_path / "two.pt")
    x = torch.randn(5, 4)
    torch.testing.assert_close(
        posthoc.load(tmp_path / "two.pt", members).predict(x).probs, posthoc.wrap(members).predict(x).probs
    )
    with torch.no_grad():
        members[1].bias += 1
    with pytest.raises(PosteriorFileError, match="member 1"):
        posthoc.load(tmp_path / "two.pt", members)
    um = posthoc.wrap(members[0], method="none")
    um.save(tmp_path / "one.pt")
    assert posthoc.load(tmp_path / "one.pt", members[0]).methods == ["none"]
