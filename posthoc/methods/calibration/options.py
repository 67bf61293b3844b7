"""What every calibrator, of logits or of regression predictions, says about its options and its choice, and how it
is written to and read from a file.

Example:
    >>> from posthoc.methods.calibration.method import TemperatureScaling
    >>> TemperatureScaling.option_defaults()
    {'max_iter': 100, 'shift_weight': 'auto'}
"""

from __future__ import annotations

import inspect
import os
from typing import Any, ClassVar

from torch import Tensor

from posthoc.core import persistence
from posthoc.core.method import load_tensors
from posthoc.errors import PosteriorFileError

#: the class a calibrator file records (``posthoc.load`` refuses it and names ``posthoc.calibrate.load``)
FILE_KIND = persistence.CALIBRATOR_CLASS


def keyword_defaults(function: Any) -> dict[str, Any]:
    """The keyword-only arguments of ``function`` with their defaults: a calibrator's options are those of its
    ``__init__`` (``TemperatureCalibrator(max_iter=50)``); a method's are the fields of its ``Options`` instead.

    Example:
        >>> keyword_defaults(lambda x, *, bins=15: x)
        {'bins': 15}
    """
    params = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


class CalibratorOptions:
    """Mixin: the options a calibrator takes (its keyword-only ``__init__`` arguments) and the name it stands for."""

    name: ClassVar[str] = ""

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The options this calibrator accepts, with their defaults."""
        return keyword_defaults(cls.__init__)

    @property
    def options(self) -> dict[str, Any]:
        """The options this calibrator was built with (what ``save`` records)."""
        return {name: getattr(self, name) for name in self.option_defaults()}

    @property
    def chosen_name(self) -> str:
        """The calibrator that maps the predictions: its own name, or for ``"auto"`` the one it chose."""
        return self.name

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        """The cross-validated table of ``"auto"`` (calibrator -> its scores); ``{}`` otherwise."""
        return {}

    def file_entry(self) -> dict[str, Any]:
        """What a saved file records of this calibrator to build it again: its name and options."""
        return {"name": self.name, "options": self.options}

    def save(self, path: str | os.PathLike) -> None:
        """Write the fitted calibrator to ``path`` (atomically; read back with ``posthoc.calibrate.load``).

        Example:
            >>> posthoc.calibrate(logits, labels, method="vector").save("vector.pt")
            >>> posthoc.calibrate.load("vector.pt").chosen_name
            'vector'
        """
        persistence.write(path, [self.file_entry()], "", FILE_KIND, dict(self.named_buffers()))

    def load_buffers(self, state: dict[str, Tensor], *, source: str = "the saved state") -> None:
        """Set buffers from ``state`` (shapes may differ from the unfitted ones)."""
        try:
            load_tensors(self, state)
        except (KeyError, AttributeError) as err:
            raise PosteriorFileError(f"{source} does not match calibrator '{self.name}': unexpected entry {err}") from err
