"""Posthoc files cannot crash the loader, and a failed save leaves the previous file intact.

Property (fuzzed with hypothesis over cuts, flipped bytes and random files, and tried on the odd paths):
``posthoc.load`` / ``posthoc.calibrate.load`` either reproduce the saved object exactly or raise a
``PosteriorFileError`` naming the path, never another exception. ``benchmarks/fuzz_files.py`` runs the
same checks at length (every offset, every byte).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import posthoc
from posthoc.core import persistence
from posthoc.errors import PosteriorFileError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fuzz_files  # noqa: E402  (the damage and the property, shared with the benchmark)

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each kind: its saved file's bytes, its loader, the tensors a correct load gives, and a scratch path."""
    folder = tmp_path_factory.mktemp("files")
    out = {}
    for kind, (path, load) in fuzz_files.originals(folder).items():
        out[kind] = (path.read_bytes(), load, load(path), folder / f"damaged_{kind}.pt")
    return out


def _property(saved, kind: str, data: bytes) -> str:
    original, load, expected, scratch = saved[kind]
    scratch.write_bytes(data)
    result = fuzz_files.outcome(load, scratch, expected)
    assert not result.startswith("WRONG"), result
    return result


@pytest.mark.parametrize("kind", fuzz_files.KINDS)
@FUZZ
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_a_cut_file_is_refused(saved, kind, fraction):
    original = saved[kind][0]
    assert _property(saved, kind, fuzz_files.truncated(original, int(fraction * len(original)))) == "refused"


@pytest.mark.parametrize("kind", fuzz_files.KINDS)
@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 255)), min_size=1, max_size=3))
def test_flipped_bytes_load_the_original_exactly_or_are_refused(saved, kind, flips):
    _property(saved, kind, fuzz_files.flipped(saved[kind][0], flips))


@pytest.mark.parametrize("kind", fuzz_files.KINDS)
@FUZZ
@given(body=st.binary(max_size=2048), zip_header=st.booleans())
def test_random_bytes_are_refused(saved, kind, body, zip_header):
    assert _property(saved, kind, (b"PK\x03\x04" if zip_header else b"") + body) == "refused"


def test_the_odd_paths_are_refused_naming_them(saved, tmp_path):
    originals = {kind: tmp_path / f"{kind}.pt" for kind in fuzz_files.KINDS}
    for kind, path in originals.items():
        path.write_bytes(saved[kind][0])
    for name, path in fuzz_files.odd_paths(tmp_path, originals).items():
        for kind in fuzz_files.KINDS:
            result = fuzz_files.outcome(saved[kind][1], path, saved[kind][2])
            assert result == ("same" if name == f"the {kind} file" else "refused"), (name, kind, result)


def test_each_kind_of_file_names_the_function_that_loads_it(saved, tmp_path):
    posterior, calibrator = tmp_path / "p.pt", tmp_path / "c.pt"
    posterior.write_bytes(saved["posterior"][0])
    calibrator.write_bytes(saved["calibrator"][0])
    with pytest.raises(
        PosteriorFileError, match=r"c\.pt is a calibrator file.*load it with posthoc\.calibrate\.load\(path\)"
    ):
        saved["posterior"][1](calibrator)
    with pytest.raises(
        PosteriorFileError, match=r"p\.pt is a posterior file.*load it with posthoc\.load\(path, model\)"
    ):
        saved["calibrator"][1](posterior)
    with pytest.raises(PosteriorFileError, match="a directory, not a posterior file"):
        saved["posterior"][1](tmp_path)
    with pytest.raises(PosteriorFileError, match="file path must be a non-empty string"):
        persistence.read(None)


def test_a_changed_tensor_is_refused_by_the_checksum(saved, tmp_path):
    path = tmp_path / "p.pt"
    path.write_bytes(saved["posterior"][0])
    payload = torch.load(path, weights_only=True)
    name = next(iter(payload["state"]))
    payload["state"][name] = payload["state"][name] + 1
    torch.save(payload, path)
    with pytest.raises(PosteriorFileError, match="does not match the checksum"):
        saved["posterior"][1](path)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda spec: spec[0]["options"].update(newer_option=1), "unknown option(s) ['newer_option']"),
        (lambda spec: spec[0].update(name="a-newer-method"), "unknown method 'a-newer-method'"),
        (lambda spec: spec[0].update(likelihood={"name": "poisson"}), "got 'poisson'"),
    ],
)
def test_a_file_from_a_newer_posthoc_is_refused_naming_this_version(saved, tmp_path, edit, says):
    """A spec this version cannot build, with a valid checksum (a file saved by a newer posthoc): a PosteriorFileError
    naming this posthoc's version and the format it reads (was: the method's or the likelihood's raw TypeError, or a
    ConfigError about arguments the user never passed)."""
    path = tmp_path / "newer.pt"
    path.write_bytes(saved["posterior"][0])
    payload = torch.load(path, weights_only=True)
    edit(payload["spec"])
    payload.pop("checksum")
    payload["checksum"] = persistence.checksum(payload)
    torch.save(payload, path)
    with pytest.raises(
        PosteriorFileError, match="that this posthoc \\(version .*, posterior format 2\\) cannot build"
    ) as refused:
        saved["posterior"][1](path)
    assert says in str(refused.value) and "upgrade posthoc" in str(refused.value)


def _calibrator():
    return posthoc.calibrate(torch.randn(60, 3) * 2, torch.arange(60) % 3)


@pytest.mark.parametrize("save", ["posterior", "calibrator"])
def test_saving_where_a_parent_is_a_file_or_into_a_folder_is_refused(save, saved, tmp_path):
    obj = _calibrator() if save == "calibrator" else _fitted()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(PosteriorFileError, match=r"cannot save to .*file/x\.pt: the folder .* cannot be created"):
        obj.save(tmp_path / "file" / "x.pt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(PosteriorFileError, match=r"cannot save to .*folder.*; any file that was there is unchanged"):
        obj.save(tmp_path / "folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"] and not list(
        (tmp_path / "folder").iterdir()
    )


def _fitted():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a random model: its temperature hits the bound
        return posthoc.wrap(model, method="temperature").fit(
            val_loader=[(torch.randn(40, 4), torch.arange(40) % 3)], progress=False
        )


@pytest.mark.parametrize("save", ["posterior", "calibrator"])
def test_a_read_only_folder_is_refused(save, tmp_path, monkeypatch):
    obj = _calibrator() if save == "calibrator" else _fitted()
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() != 0:  # root writes anywhere: simulate the refusal there
        folder.chmod(0o500)
    else:

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(persistence.tempfile, "mkstemp", refuse)
    try:
        with pytest.raises(
            PosteriorFileError, match="cannot be created or written \\(Permission denied\\); choose a path"
        ):
            obj.save(folder / "x.pt")
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("save", ["posterior", "calibrator"])
def test_a_failed_save_leaves_the_previous_file_intact(save, tmp_path, monkeypatch):
    obj = _calibrator() if save == "calibrator" else _fitted()
    path = tmp_path / "x.pt"
    obj.save(path)
    before = path.read_bytes()

    def full_disk(payload, stream):
        stream.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(PosteriorFileError, match="No space left on device.*any file that was there is unchanged"):
        obj.save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["x.pt"]
    monkeypatch.undo()
    assert persistence.read(path, kind=save)["spec"][0]["name"] in ("temperature",)
