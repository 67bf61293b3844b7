"""``posthoc.calibrate``: calibrating a deployed classifier from its saved logits alone.

Calibrators (see :mod:`posthoc.methods.calibration`): ``"temperature"`` (default), ``"vector"``,
``"matrix"`` (ODIR), ``"dirichlet"``, ``"ets"``, ``"histogram"``, ``"isotonic"``, ``"platt"``
(binary), ``"identity"``, and ``"auto"`` (k-fold cross-validated NLL over the others, never worse
than ``"identity"`` on the folds).

Example:
    >>> calibrator = posthoc.calibrate(val_logits, val_labels, method="auto")
    >>> calibrator.chosen_name, calibrator.scores["temperature"]["nll"]
    ('temperature', 0.0791)
    >>> probs = calibrator(test_logits)
    >>> calibrator.save("calibrator.pt"); posthoc.calibrate.load("calibrator.pt")
"""

from __future__ import annotations

import os
from typing import Any

from posthoc.core import persistence
from posthoc.core.checks import known_name, known_options, positive_int
from posthoc.core.errors import ConfigError, InputError, PosteriorFileError
from posthoc.core.inputs import check_labels
from posthoc.core.logits import as_class_logits, check_finite_logits, check_not_probabilities
from posthoc.methods.calibration import Calibrator, calibrators
from posthoc.methods.calibration.base import as_tensor


def calibrate(logits: Any, labels: Any, method: str = "temperature", *, max_iter: int = 100, **options: Any) -> Calibrator:
    """Fit a calibrator on held-out ``logits`` ``(N, C)`` (or ``(N,)`` for binary) and ``labels`` ``(N,)``.

    Args:
        logits: the classifier's held-out logits (before the softmax), a tensor or numpy array.
        labels: integer class indices in ``[0, C)``.
        method: the calibrator (see the module docs); ``"auto"`` picks one by cross-validated NLL.
        max_iter: L-BFGS iterations for the calibrators fitted by optimisation.
        **options: the calibrator's options, e.g. ``bins=10`` (histogram), ``off_diagonal=1e-3``
            (matrix, dirichlet), ``folds=5`` or ``candidates=["temperature", "vector"]`` (auto).

    Returns:
        The fitted calibrator: ``calibrator(logits)`` gives probabilities, ``.predict(logits)`` a
        :class:`~posthoc.Prediction`, ``.log_probs(logits)``, ``.chosen_name`` (for ``"auto"`` the chosen
        one), ``.scores`` (``"auto"``: cross-validated NLL and ECE per calibrator), ``.save(path)``.

    Example:
        >>> calibrator = posthoc.calibrate(np.load("val_logits.npy"), np.load("val_labels.npy"))
        >>> calibrator(np.load("test_logits.npy")).sum(-1)   # rows sum to 1
    """
    cls = calibrators()[known_name(method, "calibration method", calibrators())]
    options = known_options(options, cls.option_defaults(), f"calibrator '{method}'")
    positive_int(max_iter, "max_iter")
    if "max_iter" in cls.option_defaults():
        options["max_iter"] = max_iter
    logits, labels = as_tensor(logits, "logits"), as_tensor(labels, "labels")
    if logits.shape[0] != labels.reshape(-1).shape[0]:
        raise InputError(
            f"logits and labels have different lengths ({logits.shape[0]} vs {labels.reshape(-1).shape[0]}); "
            "pass one label per row of logits"
        )
    if logits.shape[0] == 0:
        raise InputError("calibrate got no examples; pass held-out logits and labels")
    check_finite_logits(logits)
    check_not_probabilities(logits)
    class_logits = as_class_logits(logits).float()
    targets = check_labels(labels, class_logits.shape[-1])
    return cls(**options).fit(class_logits, targets)


def load_calibrator(path: str | os.PathLike) -> Calibrator:
    """Read a calibrator saved with ``calibrator.save(path)``; it refuses logits with another number of classes.

    Example:
        >>> posthoc.calibrate(logits, labels).save("t.pt")
        >>> load_calibrator("t.pt")(test_logits)
    """
    payload = persistence.read(path, kind="calibrator")
    entry = payload["spec"][0]
    known = calibrators()
    if entry["name"] not in known:
        raise PosteriorFileError(f"{path} names an unknown calibrator {entry['name']!r}")
    try:
        calibrator = known[entry["name"]](**entry["options"])
    except (TypeError, ConfigError) as err:
        raise PosteriorFileError(f"{path} holds options this posthoc cannot build '{entry['name']}' with: {err}") from err
    calibrator.load_buffers(payload["state"], source=str(path))
    return calibrator


calibrate.load = load_calibrator  # type: ignore[attr-defined]
