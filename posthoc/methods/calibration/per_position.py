"""A regressor's calibrators per position: every valid held-out position of a per-pixel regressor is a row, its image
the unit.

``posthoc.wrap(net, method="variance-scaling", dense=True, likelihood="regression")`` (or stacked on a method,
``["laplace", "variance-scaling"]``) fits the calibrator of a one-output-per-input regressor
(:mod:`~posthoc.methods.calibration.variance_scaling`, :mod:`~posthoc.methods.calibration.quantile_recalibration`)
on the inner predictive of every valid held-out position, as ``posthoc.calibrate(mean=..., std=..., targets=...)``
would on those rows, and applies it to every position at ``predict``.

``"auto"`` keeps the inner predictive or takes variance scaling (:data:`AUTO_CANDIDATES`) by the selection step
(:func:`~posthoc.engine.selection.select`): variance scaling is scored out of fold with the folds drawn over the
images, and the bound is taken over per-image mean NLL (``Scores.units``), because the positions of one image are
strongly correlated: a fold that split an image, or a bound that counted each pixel as independent, would be far too
sure. It ranks the candidates ``"first"``: variance scaling is taken only where it gains more than the tolerance.
Isotonic recalibration is no candidate: its map is flat in places, where its NLL is infinite.

Example:
    >>> import torch
    >>> from posthoc.core.prediction import RegressionPrediction
    >>> from posthoc.methods.calibration.per_position import PositionCalibration
    >>> mean = torch.randn(40 * 25, 1, generator=torch.Generator().manual_seed(0))
    >>> wide = RegressionPrediction.from_components(mean[None], None, torch.full((1, 1, 1), 4.0))  # std 2, not 1
    >>> targets = mean + torch.randn(mean.shape, generator=torch.Generator().manual_seed(1))
    >>> units = torch.arange(40).repeat_interleave(25)                                  # 40 images of 25 pixels
    >>> calibration = PositionCalibration("auto").fit(wide, targets, units)
    >>> calibration.chosen, round(float(calibration.calibrate(wide).std[0, 0]), 1)
    ('variance-scaling', 1.0)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.prediction import RegressionPrediction
from posthoc.engine.selection import Layout, Scores, Tolerance, select
from posthoc.errors import ConfigError
from posthoc.methods.calibration.auto import prediction_rows, regression_calibrators
from posthoc.methods.calibration.base import RegressionCalibrator, RegressionIdentity
from posthoc.methods.calibration.variance_scaling import VarianceScaling

#: the calibrators a per-position regressor takes after its method (``"auto"``: the choice of the module docs)
POSITION_CALIBRATORS = ("variance-scaling", "isotonic", "auto")
#: what ``"auto"`` chooses between: the inner predictive as it is, and these
AUTO_CANDIDATES = ("none", "variance-scaling")


class PositionCalibration(nn.Module):
    """The calibrator ``name`` (one of :data:`POSITION_CALIBRATORS`) of a per-position regressor (module docs)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in POSITION_CALIBRATORS:
            raise ConfigError(f"a per-position calibrator is one of {POSITION_CALIBRATORS}, got {name!r}")
        self.name = name
        self.calibrator: RegressionCalibrator = RegressionIdentity() if name == "auto" else _calibrator(name)
        #: the record of ``"auto"``'s choice (``None`` for a calibrator named outright, or before fit)
        self.selection: dict[str, Any] | None = None

    @property
    def chosen(self) -> str:
        """The calibrator applied: ``"none"`` (the inner predictive as it is), ``"variance-scaling"``, ``"isotonic"``."""
        return "none" if isinstance(self.calibrator, RegressionIdentity) else self.calibrator.name

    @property
    def fitted(self) -> bool:
        return int(self.calibrator.num_outputs) > 0

    def fit(
        self,
        prediction: RegressionPrediction,
        targets: Tensor,
        units: Tensor,
        *,
        tolerance: Tolerance | float | None = None,
    ) -> PositionCalibration:
        """Fit on the held-out rows: the inner ``prediction`` ``(R, D)`` of every valid position, its ``targets``
        ``(R, D)``, and the image ``units`` ``(R,)`` each row belongs to; ``"auto"`` chooses first (module docs)."""
        if self.name == "auto":
            self.selection = self._choose(prediction, targets, units, Tolerance.of(tolerance))
            self.calibrator = _calibrator(self.selection["chosen"])
        self.calibrator.fit(prediction, targets)
        return self

    def _choose(
        self, prediction: RegressionPrediction, targets: Tensor, units: Tensor, tolerance: Tolerance
    ) -> dict[str, Any]:
        """The selection step between the inner predictive and variance scaling scored out of fold over images."""
        plain = Scores(-prediction.log_prob(targets), units=units)
        folds = Layout(len(units), units=units).folds()  # an image's pixels in one fold (one: too few images)
        out_of_fold = torch.full((len(units),), math.inf, dtype=torch.float64)
        for fitting, scored in folds:
            fit_rows, scored_rows = fitting.clean.to(units.device), scored.clean.to(units.device)
            fitted = VarianceScaling().fit(prediction_rows(prediction, fit_rows), targets[fit_rows])
            nll = -fitted.calibrate(prediction_rows(prediction, scored_rows)).log_prob(targets[scored_rows])
            out_of_fold[scored.clean] = nll.double().cpu()
        selection = select(
            [(name, name) for name in AUTO_CANDIDATES],
            [plain, Scores(out_of_fold)],
            plain=plain,
            tolerance=tolerance.nats(plain.nll),
            knob="calibration",
            folds=len(folds) if len(folds) > 1 else None,
            rank_without_shift="first",
        )
        return selection.to_dict()

    def calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        """The calibrated prediction of the rows ``prediction``."""
        return self.calibrator.calibrate(prediction)

    def summary(self) -> dict[str, Any]:
        """What was asked for, what is applied, and ``"auto"``'s record."""
        card: dict[str, Any] = {"method": self.name, "chosen": self.chosen}
        if isinstance(self.calibrator, VarianceScaling):
            card["scale"] = [float(value) for value in self.calibrator.scale]
        if self.selection is not None:
            card["selection"] = self.selection
        return card

    def state(self) -> dict[str, Any]:
        """Plain data a posterior file keeps (its tensors as lists: float64 values survive exactly)."""
        return {
            "name": self.name,
            "chosen": self.chosen,
            "buffers": {key: value.tolist() for key, value in self.calibrator.named_buffers()},
            "selection": self.selection,
        }

    @classmethod
    def restored(cls, state: dict[str, Any], *, source: str = "the saved state") -> PositionCalibration:
        """The calibration :meth:`state` describes."""
        calibration = cls(state["name"])
        calibration.calibrator = _calibrator(state["chosen"])
        dtypes = {key: value.dtype for key, value in calibration.calibrator.named_buffers()}
        calibration.calibrator.load_buffers(
            {key: torch.tensor(value, dtype=dtypes.get(key)) for key, value in state["buffers"].items()}, source=source
        )
        calibration.selection = state.get("selection")
        return calibration


def _calibrator(name: str) -> RegressionCalibrator:
    return RegressionIdentity() if name == "none" else regression_calibrators()[name]()
