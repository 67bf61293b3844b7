"""Saving and loading posthoc files (fitted posteriors and calibrators) safely: the one place that
touches them on disk.

A posterior file holds the method spec, the posterior tensors and a fingerprint of the user's checkpoint (as it was
copied, for a method that fine-tunes a copy); a calibrator file has the same layout, with :data:`CALIBRATOR_CLASS` as
its ``model_class``. Writing is atomic (a temporary file, ``fsync``, rename); reading uses
``torch.load(weights_only=True)``, never executing code from the file, and verifies a SHA-256 ``checksum`` of the
content. Every failure is a :class:`~posthoc.errors.PosteriorFileError` that names the path and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posthoc.core.paths import as_path, in_folder, reason
from posthoc.errors import PosteriorFileError

#: format 2 is format 1 plus the ``checksum`` entry (format-1 files, which have none, still load)
FORMAT_VERSION = 2

#: the ``model_class`` a calibrator file records (a calibrator belongs to no model checkpoint)
CALIBRATOR_CLASS = "posthoc calibrator"

#: what :func:`read` may be asked to expect, and the function that loads each kind
KINDS = {"posterior": "posthoc.load(path, model)", "calibrator": "posthoc.calibrate.load(path)"}

#: the entries every file holds, with their types
_ENTRIES = {"format_version": int, "spec": list, "fingerprint": str, "model_class": str, "state": dict}


def _digest_tensors(digest: Any, tensors: dict[str, Any]) -> None:
    """Add the names, shapes, dtypes and bytes of the tensors in ``tensors`` to a hashlib ``digest``."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())


def fingerprint(model: nn.Module) -> str:
    """A SHA-256 over the model's class, parameter/buffer names, shapes, dtypes and values."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    _digest_tensors(digest, model.state_dict())
    return digest.hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` (the plain entries of a payload) as JSON-ready data that is the same after a save and a load."""
    if isinstance(value, dict):
        return [[repr(key), _canonical(item)] for key, item in sorted(value.items(), key=lambda pair: repr(pair[0]))]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_canonical(item) for item in value]]
    return repr(value)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    return False


def unsaveable_options(spec: list[dict]) -> list[tuple[str, str, Any]]:
    """``(method, option, value)`` for every option of ``spec`` that a posterior file cannot keep: anything but
    numbers, strings, booleans, ``None`` and lists or dicts of them.

    Example:
        >>> from posthoc.core.persistence import unsaveable_options
        >>> unsaveable_options([{"name": "tta", "options": {"views": 4, "augmentations": ["noise", abs]}}])
        [('tta', 'augmentations', ['noise', <built-in function abs>])]
    """
    return [
        (entry["name"], key, value)
        for entry in spec
        for key, value in entry.get("options", {}).items()
        if not _plain(value)
    ]


def checksum(payload: dict) -> str:
    """The SHA-256 of a payload's content: its plain entries and its state tensors (not the checksum itself)."""
    plain = {key: value for key, value in payload.items() if key not in ("state", "checksum")}
    digest = hashlib.sha256(json.dumps(_canonical(plain)).encode())
    _digest_tensors(digest, dict(sorted(payload.get("state", {}).items())))
    return digest.hexdigest()


def fingerprint_tensor(hex_digest: str) -> torch.Tensor:
    """A fingerprint as 32 ``uint8`` values, so that it can live in a posterior's buffers."""
    return torch.tensor(list(bytes.fromhex(hex_digest)), dtype=torch.uint8)


def fingerprint_hex(values: torch.Tensor) -> str:
    """The hex fingerprint stored by :func:`fingerprint_tensor`."""
    return bytes(values.to("cpu", torch.uint8).tolist()).hex()


def ensemble_members(payload: dict) -> list[str] | None:
    """The member fingerprints of an ensemble's posterior file (its spec's base entry has ``"members"``), in member
    order; ``None`` for one model.

    Example:
        >>> from torch import nn
        >>> import posthoc
        >>> from posthoc.core.persistence import ensemble_members, fingerprint, read
        >>> members = [nn.Linear(4, 3), nn.Linear(4, 3)]
        >>> posthoc.wrap(members).save("two.pt")
        >>> ensemble_members(read("two.pt")) == [fingerprint(member) for member in members]
        True
    """
    spec = payload.get("spec") or [{}]
    if "members" not in spec[0]:
        return None
    key = "inner." * (len(spec) - 1) + "member_fingerprints"
    if key not in payload["state"]:
        raise PosteriorFileError("the posterior file names an ensemble but holds no member fingerprints")
    return [fingerprint_hex(row) for row in payload["state"][key]]


def check_ensemble_members(path: str, saved: Sequence[str], given: Sequence[str]) -> None:
    """Refuse ensemble members (by fingerprint) other than the saved ones, in the saved order, naming what is wrong.

    Example:
        >>> from posthoc.core.persistence import check_ensemble_members
        >>> check_ensemble_members("e.pt", ["a", "b"], ["b", "a"])
        Traceback (most recent call last):
        posthoc.errors.PosteriorFileError: e.pt: member 0 given is saved member 1...
    """
    if len(given) != len(saved):
        missing = [i for i, f in enumerate(saved) if f not in given]
        raise PosteriorFileError(
            f"{path} holds an ensemble of {len(saved)} members but {len(given)} models were given"
            + (f" (saved member(s) {missing} are missing)" if missing else "")
            + "; pass every member, in the order they were wrapped"
        )
    for index, (want, found) in enumerate(zip(saved, given)):
        if want == found:
            continue
        if found in saved:
            raise PosteriorFileError(
                f"{path}: member {index} given is saved member {saved.index(found)}; pass the members in the "
                "order they were wrapped (each member's posterior belongs to its own checkpoint)"
            )
        raise PosteriorFileError(
            f"{path}: member {index} (fingerprint {found[:12]}) is not the checkpoint its posterior was fitted on "
            f"(fingerprint {want[:12]}): its weights or architecture changed. Load onto the exact checkpoints, "
            "or fit again"
        )


def write(
    path: str | os.PathLike,
    spec: list[dict],
    fingerprint: str,
    model_class: str,
    state: dict[str, torch.Tensor],
    *,
    fit: dict[str, int | float | None] | None = None,
    dense: dict[str, Any] | None = None,
) -> None:
    """Write a posterior to ``path`` atomically: the method ``spec``, the ``fingerprint`` and class name of the
    checkpoint it belongs to, its ``state`` tensors (on the CPU), the optional ``fit`` record, a dense model's
    ``dense`` layout and the ``checksum`` of all that. On failure the file that was at ``path``, if any, is left as it
    was.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import posthoc
        >>> from posthoc.core.persistence import fingerprint, write
        >>> net = nn.Linear(4, 3)
        >>> write("p.pt", [{"name": "temperature", "options": {}}], fingerprint(net), "Linear", {"temperature": torch.ones(())})
        >>> posthoc.load("p.pt", net).method.temperature
        tensor(1.)
    """
    payload = {
        "format_version": FORMAT_VERSION,
        "spec": spec,
        "fingerprint": fingerprint,
        "model_class": model_class,
        "state": {k: v.detach().to("cpu") for k, v in state.items()},
    }
    if fit is not None:
        payload["fit"] = dict(fit)
    if dense is not None:
        payload["dense"] = dict(dense)
    payload["checksum"] = checksum(payload)
    path = as_path(path, PosteriorFileError)
    with in_folder(path, PosteriorFileError):
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(payload, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise PosteriorFileError(
            f"cannot save to {path} ({reason(err)}); any file that was there is unchanged. "
            "Free some space or choose another path, and save again"
        ) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_payload(path: Path, kind: str) -> Any:
    """``torch.load`` of ``path`` (plain tensors only), every failure a :class:`PosteriorFileError`."""
    if path.is_dir():
        raise PosteriorFileError(f"{path} is a directory, not a {kind} file; pass the path of the file inside it")
    if not path.exists():
        raise PosteriorFileError(
            f"no {kind} file at {path}" + (" (a broken symbolic link)" if path.is_symlink() else "")
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        if path.exists() and not path.is_dir() and os.access(path, os.R_OK):
            raise PosteriorFileError(
                f"{path} is not a readable {kind} file (truncated or corrupted: {err}); save it "
                "again, or restore it from a copy"
            ) from err
        raise PosteriorFileError(
            f"cannot read {path} ({reason(err)}); check that the file exists and is readable"
        ) from err
    except Exception as err:  # the unpickler of a damaged file raises anything
        raise PosteriorFileError(
            f"{path} is not a readable {kind} file (truncated, corrupted, or it holds objects that are not plain "
            f"tensors, which are refused for safety: {type(err).__name__}: {err}); save it again, or restore it from a copy"
        ) from err


def _check_layout(path: Path, payload: Any, kind: str) -> None:
    """Refuse a payload that is not a posthoc file of a version this posthoc reads, or whose content changed."""
    if not isinstance(payload, dict) or "format_version" not in payload:
        raise PosteriorFileError(
            f"{path} is not a posthoc {kind} file (it holds no posthoc payload); pass a file "
            f"written by {'um.save' if kind == 'posterior' else 'calibrator.save'}"
        )
    version = payload["format_version"]
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise PosteriorFileError(
            f"{path} was written by a newer posthoc (format {version}, this one reads "
            f"up to {FORMAT_VERSION}); upgrade posthoc to load it"
        )
    wrong = [key for key, kind_of in _ENTRIES.items() if not isinstance(payload.get(key), kind_of)]
    spec, state = payload.get("spec"), payload.get("state")
    if not wrong and (
        isinstance(version, bool)
        or version < 1
        or not spec
        or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("options"), dict) for e in spec
        )
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
        or not isinstance(payload.get("fit", {}), dict)
        or not isinstance(payload.get("dense", {}), dict)
    ):
        wrong = ["format_version, spec, state, fit or dense"]
    if wrong:
        raise PosteriorFileError(
            f"{path} is a damaged posthoc {kind} file (bad entries: {', '.join(wrong)}); save it "
            "again, or restore it from a copy"
        )
    if "checksum" in payload or version >= 2:
        if payload.get("checksum") != checksum(payload):
            raise PosteriorFileError(
                f"{path} is corrupted: its content does not match the checksum written with it; "
                "save it again, or restore it from a copy"
            )


def read(path: str | os.PathLike, kind: str = "posterior") -> dict:
    """Read and validate a posthoc file without applying it; a file of another ``kind`` than the caller loads
    (``"posterior"`` or ``"calibrator"``) is refused with the function that loads it.

    Example:
        >>> import posthoc
        >>> from posthoc.core.persistence import read
        >>> from posthoc_apps.demo.examples import logits, labels
        >>> posthoc.calibrate(logits, labels).save("calibrator.pt")
        >>> read("calibrator.pt", kind="posterior")
        Traceback (most recent call last):
        posthoc.errors.PosteriorFileError: calibrator.pt is a calibrator file...; load it with posthoc.calibrate.load(path)
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    path = as_path(path, PosteriorFileError)
    payload = _load_payload(path, kind)
    _check_layout(path, payload, kind)
    found = "calibrator" if payload["model_class"] == CALIBRATOR_CLASS else "posterior"
    if found != kind:
        holds = (
            "a fitted calibrator (calibrator.save)" if found == "calibrator" else "the posterior of a model (um.save)"
        )
        raise PosteriorFileError(
            f"{path} is a {found} file: it holds {holds}, not a {kind}; load it with {KINDS[found]}"
        )
    return payload
