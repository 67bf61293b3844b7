"""Saving and loading fitted posteriors safely.

A posterior file holds the method spec, the posterior tensors and a fingerprint of the user's
checkpoint it belongs to (for methods that fine-tune a copy, the checkpoint as it was copied; the
copy's weights are part of the posterior). Files are written atomically (temporary file + rename) and read with
``torch.load(weights_only=True)``, so loading never executes code from the file, and a posterior
is never applied to a model whose architecture or weights differ.

Example:
    >>> um.save("net.laplace.pt")
    >>> read("net.laplace.pt")["spec"]
    [{'name': 'laplace', 'options': {}}]
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import zipfile
from pathlib import Path

import torch
from torch import nn

from posthoc.core.errors import PosteriorFileError

FORMAT_VERSION = 1


def fingerprint(model: nn.Module) -> str:
    """A SHA-256 over the model's class, parameter/buffer names, shapes, dtypes and values.

    Example:
        >>> fingerprint(nn.Linear(2, 2)) == fingerprint(nn.Linear(2, 2))
        False
    """
    digest = hashlib.sha256(type(model).__qualname__.encode())
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor):
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fingerprint_tensor(hex_digest: str) -> torch.Tensor:
    """A fingerprint as 32 ``uint8`` values, so that it can live in a posterior's buffers.

    Example:
        >>> fingerprint_hex(fingerprint_tensor("ab" * 32)) == "ab" * 32
        True
    """
    return torch.tensor(list(bytes.fromhex(hex_digest)), dtype=torch.uint8)


def fingerprint_hex(values: torch.Tensor) -> str:
    """The hex fingerprint stored by :func:`fingerprint_tensor`."""
    return bytes(values.to("cpu", torch.uint8).tolist()).hex()


def ensemble_members(payload: dict) -> list[str] | None:
    """The member fingerprints of an ensemble's posterior file, in member order; ``None`` for one model.

    An ensemble's spec marks its base entry with ``"members"``; its fingerprints are the state entry
    ``member_fingerprints`` of the ensemble (under one ``inner.`` per method stacked on top of it).

    Example:
        >>> ensemble_members(read("three.pt"))[:1]
        ['4f1c...']
    """
    spec = payload.get("spec") or [{}]
    if "members" not in spec[0]:
        return None
    key = "inner." * (len(spec) - 1) + "member_fingerprints"
    if key not in payload["state"]:
        raise PosteriorFileError("the posterior file names an ensemble but holds no member fingerprints")
    return [fingerprint_hex(row) for row in payload["state"][key]]


def write(path: str | os.PathLike, spec: list[dict], fingerprint: str, model_class: str, state: dict[str, torch.Tensor],
          *, fit: dict[str, int | float | None] | None = None) -> None:
    """Write a posterior to ``path`` atomically: the method ``spec``, the ``fingerprint`` and class name of
    the checkpoint it belongs to, its ``state`` tensors (moved to the CPU) and, when given, the ``fit``
    record of the model card (plain numbers under the optional key ``"fit"``; files without it, all
    format-1 files written before it existed, still load).

    Example:
        >>> write("p.pt", [{"name": "temperature", "options": {}}], fingerprint(net), "Net", {"temperature": torch.ones(())})
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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(payload, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: str | os.PathLike) -> dict:
    """Read and validate a posterior file without applying it."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise PosteriorFileError(f"no posterior file at {path}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as err:
        raise PosteriorFileError(
            f"{path} is not a readable posterior file (truncated, corrupted, or it holds objects "
            f"that are not plain tensors, which are refused for safety): {err}"
        ) from err
    if not isinstance(payload, dict) or "format_version" not in payload:
        raise PosteriorFileError(f"{path} is not a posthoc posterior file")
    if payload["format_version"] > FORMAT_VERSION:
        raise PosteriorFileError(
            f"{path} was written by a newer posthoc (format {payload['format_version']}, this one reads "
            f"up to {FORMAT_VERSION}); upgrade posthoc to load it"
        )
    return payload
