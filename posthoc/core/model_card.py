""":class:`ModelCard`: what a posterior is over, as a dict and as Markdown (``um.summary()``).

A card holds plain Python values (it dumps as JSON): the methods and their options, per method its
:meth:`~posthoc.core.method.Method.summary` (``random_variables``, ``layers`` and what it chose at fit),
the total number of random variables, the data and cost of the fit, and the model it belongs to.

Example:
    >>> card = um.summary()
    >>> card["methods"], card["random_variables"]
    (['mc-dropout'], 64)
    >>> print(card.to_markdown().splitlines()[0])
    # Model card: mc-dropout
"""

from __future__ import annotations

from typing import Any

from posthoc.core.fit_record import FitRecord

#: list values longer than this show their first entries and how many there are in all
SHOWN_ITEMS = 8


class ModelCard(dict):
    """The card of an :class:`~posthoc.core.uncertain_model.UncertainModel`; build it with :meth:`of`.

    Keys: ``methods`` (inner first), ``fitted``, ``random_variables`` (summed over the methods;
    ``None`` while a method cannot tell yet), ``posterior`` (one dict per method: ``method``,
    ``options``, ``fitted`` and its ``Method.summary()``), ``train_examples`` / ``val_examples`` /
    ``fit_wall_seconds`` / ``fit_cpu_seconds`` (``None`` when not fitted here or not recorded),
    ``model_class``, ``fingerprint`` and ``posthoc_version``.

    Example:
        >>> ModelCard.of([{"method": "none", "options": {}, "fitted": True, "random_variables": 0, "layers": []}],
        ...              None, model_class="Net", fingerprint="ab12", version="0.1.0")["random_variables"]
        0
    """

    @classmethod
    def of(cls, posterior: list[dict[str, Any]], fit: FitRecord | None, *, model_class: str, fingerprint: str | None,
           version: str) -> ModelCard:
        """The card of a chain of methods described by ``posterior`` (inner first), fitted as ``fit`` tells."""
        counts = [entry.get("random_variables") for entry in posterior]
        return cls(
            methods=[entry["method"] for entry in posterior],
            fitted=all(entry["fitted"] for entry in posterior),
            random_variables=None if None in counts else sum(counts),
            posterior=posterior,
            train_examples=None if fit is None else fit.train_examples,
            val_examples=None if fit is None else fit.val_examples,
            fit_wall_seconds=None if fit is None else fit.wall_seconds,
            fit_cpu_seconds=None if fit is None else fit.cpu_seconds,
            model_class=model_class,
            fingerprint=fingerprint,
            posthoc_version=version,
        )

    def to_markdown(self) -> str:
        """The card as Markdown: a table of the model-level keys, then a table per method.

        Example:
            >>> print(um.summary().to_markdown())   # doctest: +SKIP
            # Model card: laplace + temperature
            ...
        """
        lines = [f"# Model card: {' + '.join(self['methods'])}", ""]
        lines += _table({key: value for key, value in self.items() if key != "posterior"})
        for position, entry in enumerate(self["posterior"], start=1):
            lines += ["", f"## {position}. {entry['method']}", ""]
            details = {f"options.{key}": value for key, value in entry["options"].items()}
            details.update((key, value) for key, value in entry.items() if key not in ("method", "options"))
            lines += _table(details)
        return "\n".join(lines) + "\n"


def _table(values: dict[str, Any]) -> list[str]:
    rows = ["| key | value |", "|---|---|"]
    return rows + [f"| {_cell(key)} | {_cell(_shown(value))} |" for key, value in values.items()]


def _shown(value: Any) -> str:
    """A value as a short string: 4 significant digits for floats, long lists cut after :data:`SHOWN_ITEMS`."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_shown(item) for item in value[:SHOWN_ITEMS])
        return f"{shown}, ... ({len(value)} in all)" if len(value) > SHOWN_ITEMS else (shown or "(none)")
    if isinstance(value, dict):
        return ", ".join(f"{key}={_shown(item)}" for key, item in value.items()) or "(none)"
    return str(value)


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")
