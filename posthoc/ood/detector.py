"""``posthoc.detector``: post-hoc OOD scores on a model's own logits, features and predictive.

One :class:`Detector` computes one or several scores; for each batch the model runs once and every score reads its
features (the head's input, split where the methods split), logits and predictive. ``fit`` streams the training
loader and the scores keep running sums, reduced over ``torch.distributed`` ranks. Every score is larger for inputs
that look more out-of-distribution.

A regressor has no logits to score: its detector takes :data:`REGRESSION_SCORES` (``"knn"`` and ``"mahalanobis"``
on the head's input, Mahalanobis to the one mean of the training features, and ``"variance"`` for a wrapped one).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> det = posthoc.detector(model, score=["energy", "mahalanobis", "knn"]).fit(train_loader)
    >>> det.scores(x)["mahalanobis"].shape
    torch.Size([8])
    >>> posthoc.detector(model, score="energy", temperature=2.0).score(x).shape
    torch.Size([8])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posthoc import settings
from posthoc.core import distributed
from posthoc.core.checks import generator as check_generator
from posthoc.core.checks import positive_int
from posthoc.core.inputs import Inputs, check_batch, check_labels, iterate, slice_inputs, to_device
from posthoc.core.modules import eval_mode
from posthoc.core.options import build
from posthoc.core.prediction import Prediction
from posthoc.engine.head import FeatureSplit
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError, InputError, NumericalError
from posthoc.ood.base import Outputs, Score
from posthoc.ood.head_geometry import FDBD, NCI, MaxCosine
from posthoc.ood.knn import KNN
from posthoc.ood.logits import Energy, MaxLogit
from posthoc.ood.mahalanobis import Mahalanobis, RelativeMahalanobis
from posthoc.ood.nnguide import NNGuide
from posthoc.ood.openmax import OpenMax
from posthoc.ood.predictive import (
    PREDICTION,
    GeneralizedEntropy,
    MaxSoftmax,
    MutualInformation,
    PredictiveEntropy,
    PredictiveVariance,
)
from posthoc.ood.profiles import SHE, KLMatching
from posthoc.ood.shaping import ASH, DICE, LogitScaling, ReAct, Scale
from posthoc.ood.vim import ViM

#: every score by name, in the order tables list them
SCORES: dict[str, type[Score]] = {
    cls.name: cls
    for cls in (
        MaxSoftmax,
        MaxLogit,
        Energy,
        PredictiveEntropy,
        MutualInformation,
        GeneralizedEntropy,
        KLMatching,
        OpenMax,
        ASH,
        ReAct,
        Scale,
        DICE,
        LogitScaling,
        Mahalanobis,
        RelativeMahalanobis,
        ViM,
        KNN,
        NNGuide,
        MaxCosine,
        FDBD,
        NCI,
        SHE,
        PredictiveVariance,
    )
}
#: the scores a regressor's detector takes
REGRESSION_SCORES = tuple(name for name, cls in SCORES.items() if "regression" in cls.tasks)


def available_scores(likelihood: str = "classification") -> list[str]:
    """The names ``posthoc.detector(..., score=...)`` accepts for a classifier (or under ``likelihood``).

    Example:
        >>> from posthoc.ood.detector import available_scores
        >>> available_scores()[:3]
        ['msp', 'max-logit', 'energy']
        >>> available_scores("regression")
        ['mahalanobis', 'knn', 'variance']
    """
    task = "classification" if likelihood == "classification" else "regression"
    return [name for name, cls in SCORES.items() if task in cls.tasks]


def _device_of(x: Inputs) -> torch.device:
    return next(v for v in x.values() if isinstance(v, Tensor)).device if isinstance(x, Mapping) else x.device


class Detector:
    """OOD scores of one model; built by :func:`detector`. ``um`` is the wrapped model whose predictive the
    predictive scores read (``None`` for a plain model: they read its softmax)."""

    def __init__(
        self,
        model: nn.Module | UncertainModel,
        scores: Sequence[Score],
        *,
        head: str | nn.Module | None = None,
        num_samples: int | None = None,
        regression: bool = False,
    ) -> None:
        self.regression = regression
        self.um = model if isinstance(model, UncertainModel) else None
        self.model = model.method.base_model if isinstance(model, UncertainModel) else model
        self.split = FeatureSplit(self.model, head)
        self._scores = {score.name: score for score in scores}
        self.num_samples = num_samples
        self.feature_width: int | None = None

    @property
    def names(self) -> list[str]:
        return list(self._scores)

    @property
    def requires_fit(self) -> bool:
        """Whether any of the scores needs training statistics."""
        return any(score.fit_passes for score in self._scores.values())

    @property
    def device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def __repr__(self) -> str:
        return f"Detector(scores={self.names}, fitted={all(s.fitted for s in self._scores.values())})"

    def _plain_predictive(self) -> bool:
        return not self.regression and (self.um is None or self.um.methods == ["none"])

    def _check_width(self, features: Tensor) -> None:
        width = features.shape[-1]
        if self.feature_width is not None and width != self.feature_width:
            raise InputError(
                f"the head '{self.split.head_name}' receives {width} features but the detector was fitted on "
                f"{self.feature_width}: the model changed since fit; fit the detector again on this model"
            )

    def _check_finite(self, features: Tensor, logits: Tensor) -> None:
        head = f"features (the input of its head '{self.split.head_name}')"
        for what, values in ((head, features), ("logits", logits)):
            if not bool(torch.isfinite(values).all()):
                raise NumericalError(
                    f"the model's {what} hold NaN or inf for these inputs (the inputs are finite): no OOD score is "
                    "meaningful on them; check the model's weights and dtype (e.g. float16 overflow)"
                )

    def _outputs(self, x: Inputs, uses: frozenset[str], generator: torch.Generator | None) -> Outputs:
        features = logits = prediction = None
        if uses & {"features", "logits"} or ("prediction" in uses and self._plain_predictive()):
            with eval_mode(self.model):
                features, logits = self.split(x)
            self._check_width(features)
            self._check_finite(features, logits)
        if "prediction" in uses:
            prediction = (
                Prediction.from_log_probs(torch.log_softmax(logits.float(), -1))
                if self._plain_predictive()
                else self.um.predict(x, num_samples=self.num_samples, generator=generator, keep_samples=False)
            )
        return Outputs(features, logits, prediction, self.split.head)

    def _chosen(self, names: Iterable[str] | None) -> list[Score]:
        names = self.names if names is None else list(names)
        unknown = [name for name in names if name not in self._scores]
        if unknown:
            raise ConfigError(f"score(s) {unknown} are not computed by this detector; it computes {self.names}")
        chosen = [self._scores[name] for name in names]
        for score in chosen:
            score.check_fitted()
        return chosen

    @torch.no_grad()
    def fit(self, train_loader: Iterable, *, progress: bool = True) -> Detector:
        """Collect the training statistics of the scores that need them; returns ``self``. ``"vim"`` takes a second
        pass when the training features exceed its ``max_memory``; ``"mahalanobis"`` reads a classifier's labels."""
        active = [score for score in self._scores.values() if score.fit_passes]
        for score in active:
            score.reset()
        self.feature_width = None
        pass_index = 0
        while active:
            uses = frozenset().union(*(score.uses for score in active))
            labelled = any(score.needs_labels for score in active)
            for x, y in iterate(
                train_loader,
                device=self.device,
                progress=progress,
                require_labels=labelled,
                desc=f"OOD statistics, pass {pass_index + 1}",
            ):
                outputs = self._outputs(x, uses, None)
                self.feature_width = outputs.features.shape[-1]
                if self.regression:  # one "class": the training features' mean
                    labels = torch.zeros(outputs.features.shape[0], dtype=torch.long, device=outputs.features.device)
                else:
                    labels = check_labels(y, outputs.logits.shape[-1]) if labelled else None
                for score in active:
                    score.update(outputs, labels, pass_index)
            for score in active:
                score.finish(pass_index)
                score.check_statistics()
            active = [score for score in active if not score.fitted]
            pass_index += 1
        return self

    @torch.no_grad()
    def scores(
        self, x: Inputs, names: Iterable[str] | None = None, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Every score (or those in ``names``) of a batch ``x``, each ``(N,)`` on ``x``'s device; larger = more OOD."""
        chosen = self._chosen(names)
        uses = frozenset().union(*(score.uses for score in chosen))
        check_generator(generator)
        total = check_batch(x, "detector.score")
        parts: dict[str, list[Tensor]] = {score.name: [] for score in chosen}
        step, home = positive_int(settings.chunk_size, "posthoc.settings.chunk_size"), _device_of(x)
        for start in range(0, total, step):
            outputs = self._outputs(to_device(slice_inputs(x, start, start + step), self.device), uses, generator)
            for score in chosen:
                parts[score.name].append(score(outputs).to(home))
        return {name: torch.cat(values) for name, values in parts.items()}

    def score(self, x: Inputs, name: str | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        """One score of a batch ``x``, ``(N,)``; ``name`` picks it when the detector computes several."""
        if name is None and len(self._scores) > 1:
            raise ConfigError(
                f"this detector computes {self.names}: name one, det.score(x, 'energy'), "
                "or take them all with det.scores(x)"
            )
        return self.scores(x, [name or self.names[0]], generator=generator)[name or self.names[0]]

    def reads_only_prediction(self, name: str) -> bool:
        """Whether score ``name`` reads nothing but the predictive (so a :class:`Prediction` in hand gives it)."""
        return self._scores[name].uses <= PREDICTION

    def prediction_scores(self, prediction: Prediction, names: Iterable[str]) -> dict[str, Tensor]:
        """The scores in ``names`` that read only the predictive, of ``prediction`` (made by ``self.um``), without
        a forward pass.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import um, x
            >>> det = posthoc.detector(um, score=["msp", "gen"])
            >>> det.prediction_scores(um.predict(x), ["msp"])["msp"].shape
            torch.Size([8])
        """
        outputs = Outputs(prediction=prediction)
        return {score.name: score(outputs) for score in self._chosen(names) if score.uses <= PREDICTION}

    @torch.no_grad()
    def score_loader(
        self,
        loader: Iterable,
        names: Iterable[str] | None = None,
        *,
        progress: bool = True,
        generator: torch.Generator | None = None,
        desc: str = "OOD scores",
    ) -> dict[str, Tensor]:
        """:meth:`scores` over every batch of ``loader`` (labels ignored), on the CPU; under ``torch.distributed``
        gathered from every rank's shard.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model, ood_loader
            >>> det = posthoc.detector(model, score=["energy", "msp"])
            >>> det.score_loader(ood_loader)["energy"].shape
            torch.Size([128])
        """
        names = [score.name for score in self._chosen(names)]
        parts: dict[str, list[Tensor]] = {name: [] for name in names}
        for x, _ in iterate(loader, device=self.device, progress=progress, require_labels=False, desc=desc):
            for name, values in self.scores(x, names, generator=generator).items():
                parts[name].append(values.cpu())
        return {name: distributed.gather_cat(torch.cat(values)) for name, values in parts.items()}


def _route_options(names: list[str], options: dict[str, Any]) -> list[dict[str, Any]]:
    accepted = [SCORES[name].option_defaults() for name in names]
    unknown = sorted(key for key in options if not any(key in valid for valid in accepted))
    if unknown:
        listing = "; ".join(
            f"{name}: " + (", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)")
            for name, valid in zip(names, accepted)
        )
        raise ConfigError(f"unknown option(s) {unknown} for score(s) {names}; valid options — {listing}")
    return [{key: value for key, value in options.items() if key in valid} for valid in accepted]


def _spec_head(um: UncertainModel) -> Any:
    """The ``head=`` a wrapped model's methods were given (so the detector splits where they do)."""
    heads = (entry.get("options", {}).get("head") for entry in um.spec)
    return next((head for head in heads if head is not None), None)


def _is_regression(model: nn.Module | UncertainModel, likelihood: str | None) -> bool:
    """Whether ``model`` is a regressor: a wrapped model's likelihood, or ``likelihood=`` for a plain one."""
    if likelihood is not None and (
        not isinstance(likelihood, str) or likelihood not in ("classification", "regression", "heteroscedastic")
    ):
        raise ConfigError(
            f"likelihood must be None (a wrapped model's own, else classification), 'classification', "
            f"'regression' or 'heteroscedastic', got {likelihood!r}"
        )
    if isinstance(model, UncertainModel):
        own = model.likelihood.name
        if likelihood is not None and (likelihood == "classification") != (own == "classification"):
            raise ConfigError(
                f"likelihood={likelihood!r} but the model was wrapped with likelihood={own!r}; leave "
                "likelihood= out for a wrapped model (its own is used)"
            )
        return own != "classification"
    return likelihood not in (None, "classification")


def _check_task(names: list[str], model: nn.Module | UncertainModel, regression: bool) -> None:
    """Refuse scores that are not for this kind of model, naming those that are."""
    task = "regression" if regression else "classification"
    wrong = [name for name in names if task not in SCORES[name].tasks]
    if wrong and regression:
        raise ConfigError(
            f"the OOD score(s) {wrong} read a classifier's logits or class probabilities; a regressor "
            f"has none. Its scores: {', '.join(REGRESSION_SCORES)} ('knn' and 'mahalanobis' on the "
            "features before its last Linear, 'variance' the predictive variance of a wrapped model)"
        )
    if wrong:
        raise ConfigError(
            f"the OOD score(s) {wrong} are for regressors (a wrapped model with likelihood='regression'); "
            f"a classifier's scores: {', '.join(available_scores())}"
        )
    if regression and "variance" in names and not isinstance(model, UncertainModel):
        raise ConfigError(
            "the 'variance' score reads a regressor's predictive variance: pass a wrapped model, e.g. "
            "posthoc.detector(posthoc.wrap(model, method='laplace', likelihood='regression').fit(train_loader, "
            "val_loader), score='variance')"
        )


def detector(
    model: nn.Module | UncertainModel,
    score: str | Sequence[str] = "energy",
    *,
    head: str | nn.Module | None = None,
    num_samples: int | None = None,
    likelihood: str | None = None,
    **options: Any,
) -> Detector:
    """A post-hoc OOD detector on ``model``: ``.fit(train_loader)`` where a score needs it, then ``.score(x)``.

    Args:
        model: a trained classifier, or a wrapped ``posthoc.UncertainModel`` (then the predictive scores read
            ``um.predict``; the others the features and logits of ``um.method.base_model``).
        score: one name or a list of names, from :func:`available_scores`; those with training statistics
            (``"mahalanobis"``, ``"vim"``, ``"knn"``, ``"react"``, ``"openmax"``, ...) need ``fit``, and
            ``"mahalanobis"``, ``"relative-mahalanobis"``, ``"she"`` and ``"openmax"`` read its labels.
        head: the classifier head's module name (default: the wrapped model's ``head=`` option, else found
            as the methods find it).
        likelihood: ``None`` (a wrapped model's own, else ``"classification"``), or ``"regression"`` for a plain
            regressor.
        **options: score options, each given to every score that accepts it (``temperature``, ``k``, ...).

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import model, train_loader, ood_loader, x
        >>> det = posthoc.detector(model, score="knn", k=10).fit(train_loader)
        >>> x_ood, _ = next(iter(ood_loader))
        >>> det.score(x_ood).mean() > det.score(x).mean()
        tensor(True)
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module or a posthoc.UncertainModel, got {type(model).__name__}")
    names = list(dict.fromkeys([score] if isinstance(score, str) else list(score)))
    unknown = [name for name in names if name not in SCORES]
    if not names or unknown:
        raise ConfigError(f"unknown OOD score(s) {unknown or names}; valid scores: {', '.join(SCORES)}")
    regression = _is_regression(model, likelihood)
    _check_task(names, model, regression)
    if "mutual-information" in names and not isinstance(model, UncertainModel):
        raise ConfigError(
            "the 'mutual-information' score needs a posterior: pass a wrapped model with samples, "
            "e.g. posthoc.detector(posthoc.wrap(model, method='laplace').fit(train_loader), ...)"
        )
    if head is None and isinstance(model, UncertainModel):
        head = _spec_head(model)
    routed = _route_options(names, options)
    return Detector(
        model,
        [build(SCORES[name], values, f"OOD score '{name}'") for name, values in zip(names, routed)],
        head=head,
        num_samples=num_samples,
        regression=regression,
    )
