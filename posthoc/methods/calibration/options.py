"""What every calibrator, of logits or of regression predictions, says about its options and choice, and its file.

Example:
    >>> from posthoc.methods.calibration.method import TemperatureScaling
    >>> TemperatureScaling.option_defaults()
    {'max_iter': 100, 'shift_weight': 'auto'}
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from torch import Tensor

from posthoc.core import persistence
from posthoc.core.method import load_tensors
from posthoc.core.options import Options as BaseOptions
from posthoc.errors import PosteriorFileError

#: the plain model's name everywhere: the wrap's ``method="none"``, a calibrator that keeps the model's own
#: probabilities (``"identity"`` is accepted as another name for it), a held-out choice that keeps them
PLAIN = "none"

#: the calibrator that keeps the model's own probabilities, by its registered name
IDENTITY = "identity"


def plain_named(name: str) -> str:
    """A calibrator's name as records, tables and warnings show it: :data:`PLAIN` for the identity."""
    return PLAIN if name == IDENTITY else name


class CalibratorOptions:
    """Mixin: the options a calibrator takes and the name it stands for.

    A calibrator declares its options as the fields of a nested ``@dataclass(frozen=True, kw_only=True) class
    Options(Calibrator.Options)``, and its ``__init__`` takes the same fields as keyword-only arguments with the same
    defaults (``TemperatureCalibrator(max_iter=50)``).
    """

    name: ClassVar[str] = ""
    #: the calibrator's options (none by default)
    Options: ClassVar[type[BaseOptions]] = BaseOptions

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The options this calibrator accepts, with their defaults: the fields of :attr:`Options`."""
        return cls.Options.defaults()

    @property
    def options(self) -> dict[str, Any]:
        """The options this calibrator was built with (what ``save`` records)."""
        return {name: getattr(self, name) for name in self.option_defaults()}

    @property
    def chosen_name(self) -> str:
        """The calibrator that maps the predictions: its own name, or for ``"auto"`` the one it chose; :data:`PLAIN`
        when that keeps the model's own probabilities (the identity, or a fit that kept them)."""
        return PLAIN if bool(getattr(self, "passthrough", False)) else plain_named(self.name)

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
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import logits, labels
            >>> posthoc.calibrate(logits, labels, method="vector").save("vector.pt")
            >>> posthoc.calibrate.load("vector.pt").chosen_name
            'vector'
        """
        persistence.write(path, [self.file_entry()], "", persistence.CALIBRATOR_CLASS, dict(self.named_buffers()))

    def load_buffers(self, state: dict[str, Tensor], *, source: str = "the saved state") -> None:
        """Set buffers from ``state`` (shapes may differ from the unfitted ones)."""
        try:
            load_tensors(self, state)
        except (KeyError, AttributeError) as err:
            raise PosteriorFileError(
                f"{source} does not match calibrator '{self.name}': unexpected entry {err}"
            ) from err
