"""Lightning integration: fit a post-hoc predictive when ``trainer.fit`` ends, and restore it from the checkpoint.

:class:`PosthocCallback` runs ``posthoc.wrap(net, method, **options).fit(train_loader, val_loader)`` on the trained
network of a ``LightningModule``, with the loaders of the datamodule (or those given to the trainer), saves the
posterior next to the best checkpoint and keeps the fitted model as ``callback.uncertain_model``. Importing
``posthoc`` never imports Lightning; only ``import posthoc_apps.lightning`` does (extra: ``pip install
'posthoc[lightning]'``).

Usage::

    from posthoc_apps.lightning import PosthocCallback

    callback = PosthocCallback(method=["laplace", "temperature"], model_attr="net")
    trainer = lightning.Trainer(max_epochs=10, callbacks=[callback])
    trainer.fit(module, datamodule=datamodule)
    callback.uncertain_model.predict(x)      # fitted on the best checkpoint's weights
    callback.posterior_path                  # e.g. checkpoints/epoch=7-step=800.posthoc.pt

    # later, in another process: the checkpoint plus the posterior file
    um = PosthocCallback.restore(callback.checkpoint_path, LitClassifier, model_attr="net")

Example:
    >>> from posthoc_apps.lightning import PosthocCallback
    >>> PosthocCallback.posterior_path_for("checkpoints/epoch=7-step=800.ckpt").name
    'epoch=7-step=800.posthoc.pt'
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from posthoc.api import load, wrap
from posthoc.core import distributed
from posthoc.core.chain import route_options
from posthoc.core.method import chain_of
from posthoc.core.registry import method_class
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError, InputError, MissingDependencyError, PosteriorFileError

#: how to get what this module needs
INSTALL_HINT = "pip install 'posthoc[lightning]'  (or: pip install 'lightning>=2,<3')"

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero_warn
except ImportError as err:  # the optional extra is not installed (or is broken)
    raise MissingDependencyError(
        f"posthoc_apps.lightning needs the lightning package, which could not be imported ({err}): {INSTALL_HINT}"
    ) from err

#: the trainer calls after which the callback can fit
STAGES = ("fit", "validate")
#: the options of ``UncertainModel.fit`` that every method takes
COMMON_FIT_OPTIONS = ("shift", "tolerance")
#: the posterior's file name in ``trainer.default_root_dir`` when no checkpoint holds the weights it was fitted on
DEFAULT_FILE = "posthoc.pt"


def network_of(module: nn.Module, model_attr: str | None = None) -> nn.Module:
    """The network of a ``LightningModule`` that posthoc wraps: the submodule ``model_attr`` names (a dotted path,
    e.g. ``"net"`` or ``"backbone.classifier"``); by default the module itself when its class defines ``forward``
    (``forward(x)`` must return logits), else its only child module with parameters. Anything else is a
    :class:`~posthoc.ConfigError` that lists the candidates.

    Example:
        >>> import lightning.pytorch as pl
        >>> from torch import nn
        >>> from posthoc_apps.lightning import network_of
        >>> class Lit(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = nn.Linear(4, 3)
        >>> type(network_of(Lit())).__name__
        'Linear'
    """
    if model_attr is not None:
        if not isinstance(model_attr, str) or not model_attr:
            raise ConfigError(
                f"model_attr must name the network's attribute, e.g. model_attr='net', got {model_attr!r}"
            )
        try:
            return module.get_submodule(model_attr)
        except AttributeError:
            raise ConfigError(
                f"{type(module).__name__} has no module {model_attr!r} (model_attr); its modules: "
                f"{_candidates(module) or 'none'}. Name the attribute that holds the classifier"
            ) from None
    if type(module).forward not in (pl.LightningModule.forward, nn.Module.forward):
        return module
    children = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
    if len(children) == 1:
        return module.get_submodule(children[0])
    found = f"it holds {len(children)} ({', '.join(children)})" if children else "it holds none"
    raise ConfigError(
        f"{type(module).__name__} defines no forward and posthoc cannot tell which module is the "
        f"network: {found}. Name it: PosthocCallback(..., model_attr='net'), with the attribute whose "
        "forward(x) returns the logits"
    )


def _candidates(module: nn.Module) -> str:
    return ", ".join(name for name, _ in module.named_children())


def _method_names(method: Any) -> list[str]:
    if not isinstance(method, (str, list, tuple)) or not method:
        raise ConfigError(
            f"method must be a method name or a non-empty list of them, e.g. method=['laplace', "
            f"'temperature'], got {method!r}"
        )
    return [method] if isinstance(method, str) else list(method)


def _stages(on: str | Sequence[str]) -> tuple[str, ...]:
    stages = (on,) if isinstance(on, str) else tuple(on)
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown or not stages:
        raise ConfigError(
            f"on={on!r}: the callback fits after one of {', '.join(STAGES)} (or both, on=('fit', "
            "'validate')), when that trainer call ends"
        )
    return stages


def _check_fit_options(names: list[str], routed: list[dict[str, Any]], fit_options: dict[str, Any]) -> None:
    """Refuse, before any training, fit options that no method of the chain takes."""
    accepted = set(COMMON_FIT_OPTIONS)
    for name, options in zip(names, routed):
        accepted |= set(method_class(name).algorithm(options).fit_option_defaults())
    unknown = sorted(set(fit_options) - accepted)
    if unknown:
        raise ConfigError(
            f"unknown fit option(s) {unknown} for method {'+'.join(names)}; valid fit options here: "
            f"{', '.join(sorted(accepted))}"
        )


def _single(loaders: Any, what: str) -> Any:
    """The one loader in what a ``*_dataloader`` hook returned (posthoc fits on one)."""
    if isinstance(loaders, (list, tuple)) and len(loaders) == 1:
        return loaders[0]
    if isinstance(loaders, dict) and len(loaders) == 1:
        return next(iter(loaders.values()))
    if isinstance(loaders, (list, tuple, dict)):
        raise InputError(
            f"the {what} returns {len(loaders)} dataloaders; posthoc fits on one loader of (x, y) "
            "batches: return one, or fit by hand: posthoc.wrap(net, method).fit(train_loader, val_loader)"
        )
    return loaders


def _source(trainer: pl.Trainer, stage: str, kind: str) -> Any:
    """Lightning's record of where the ``kind`` ("train" / "val") loader of ``stage`` comes from (a datamodule, the
    module or loaders given to the trainer), or ``None`` where it holds no such loader."""
    if kind == "train":
        source = getattr(trainer.fit_loop, "_data_source", None)
    else:
        loop = trainer.fit_loop.epoch_loop.val_loop if stage == "fit" else trainer.validate_loop
        source = getattr(loop, "_data_source", None)
    if source is None or getattr(source, "instance", None) is None or not source.is_defined():
        return None
    return source


def _name(stage: Any) -> str:
    """``"fit"`` for ``TrainerFn.FITTING`` (whose ``str`` is its Enum name), and a plain string as it is."""
    return str(getattr(stage, "value", stage))


def _sharded(loader: Any) -> bool:
    return isinstance(getattr(loader, "sampler", None), DistributedSampler)


class PosthocCallback(pl.Callback):
    """Fit ``posthoc.wrap(net, method, **options)`` on a ``LightningModule``'s network when ``trainer.fit`` ends (or
    ``trainer.validate``, with ``on="validate"``), save the posterior next to the best checkpoint, and keep the
    fitted :class:`~posthoc.UncertainModel` as :attr:`uncertain_model`.

    What it fits on:

    - **The weights:** after ``trainer.fit``, those of the ``ModelCheckpoint``'s ``best_model_path`` (loaded into a
      copy of the network when the trained one has moved on since), so that the checkpoint and the posterior file
      belong together; without a checkpoint, the trained weights. After ``trainer.validate``, the weights it
      validated (those of ``ckpt_path=`` when one is given).
    - **The data:** the training and validation loaders of the datamodule, of the module's own
      ``train_dataloader`` / ``val_dataloader``, or those given to ``trainer.fit`` (one loader each, yielding
      ``(x, y)``; ``limit_*_batches`` do not apply: posthoc reads whole loaders). A method fitted on held-out data
      (``"temperature"``, ``["laplace", "temperature"]``) without a validation loader is refused at setup, before
      any training.
    - **Across processes:** when Lightning sharded both loaders with a ``DistributedSampler`` (DDP), every rank
      fits on its shard and posthoc reduces the statistics across ranks; otherwise every rank fits alone on the
      whole data. Only global rank 0 writes the file.

    Where it saves (:attr:`posterior_path`): ``path`` if given; else next to the checkpoint, ``<checkpoint
    stem>.posthoc.pt`` (:meth:`posterior_path_for`); else ``<trainer.default_root_dir>/posthoc.pt``.
    :meth:`restore` rebuilds the fitted model from the checkpoint and that file; ``posthoc.load`` refuses a
    posterior on any other weights.

    Args:
        method: a method name or a list composing them, as for :func:`posthoc.wrap` (default ``"auto"``).
        model_attr: the attribute of the ``LightningModule`` holding the network (a dotted path for a nested
            one); default: the module itself if its class defines ``forward`` (which must then return logits),
            else its only child module with parameters.
        on: ``"fit"`` (default), ``"validate"`` or both: which trainer call ends with the fit.
        path: where to save the posterior instead (a file path).
        fit_options: options of ``um.fit`` (``tolerance``, ``shift``, a method's fit options such as SWAG's
            ``epochs``).
        likelihood: as for :func:`posthoc.wrap`.
        progress: posthoc's progress bars; default: shown when the trainer shows its own.
        **options: method options, as for :func:`posthoc.wrap`.

    Names and options are checked here; the network, the structure and the loaders when the trainer sets up.

    Example:
        >>> from posthoc_apps.lightning import PosthocCallback
        >>> callback = PosthocCallback(method=["laplace", "temperature"], model_attr="net", hessian="kron")
        >>> callback.methods, callback.uncertain_model
        (['laplace', 'temperature'], None)
    """

    def __init__(
        self,
        method: str | list[str] = "auto",
        *,
        model_attr: str | None = None,
        on: str | Sequence[str] = "fit",
        path: str | os.PathLike | None = None,
        fit_options: dict[str, Any] | None = None,
        likelihood: str = "classification",
        progress: bool | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.methods = _method_names(method)
        routed = route_options(self.methods, options)  # unknown names and options fail here, before any training
        self.fit_options = dict(fit_options or {})
        _check_fit_options(self.methods, routed, self.fit_options)
        self.method = method
        self.model_attr = model_attr
        self.stages = _stages(on)
        self.path = None if path is None else Path(path)
        self.likelihood = likelihood
        self.progress = progress
        self.options = options
        #: the fitted model after the trainer call (``None`` before)
        self.uncertain_model: UncertainModel | None = None
        #: where the posterior was saved
        self.posterior_path: Path | None = None
        #: the checkpoint holding the weights the posterior was fitted on (``None`` for the trainer's own weights)
        self.checkpoint_path: Path | None = None

    # ------------------------------------------------------------------------------------------ public helpers

    @staticmethod
    def posterior_path_for(checkpoint_path: str | os.PathLike) -> Path:
        """Where the callback saves the posterior of ``checkpoint_path``: beside it, ``<stem>.posthoc.pt``.

        Example:
            >>> from posthoc_apps.lightning import PosthocCallback
            >>> PosthocCallback.posterior_path_for("ckpt/last.ckpt").as_posix()
            'ckpt/last.posthoc.pt'
        """
        return Path(checkpoint_path).with_suffix(".posthoc.pt")

    @staticmethod
    def restore(
        checkpoint_path: str | os.PathLike,
        module_cls: type[pl.LightningModule],
        *,
        model_attr: str | None = None,
        posterior_path: str | os.PathLike | None = None,
        **load_options: Any,
    ) -> UncertainModel:
        """The fitted model, rebuilt from a Lightning checkpoint and the posterior saved beside it.

        Two steps, which you may also write out::

            module = LitClassifier.load_from_checkpoint(checkpoint_path)
            um = posthoc.load(PosthocCallback.posterior_path_for(checkpoint_path), module.net)

        ``posthoc.load`` refuses a posterior whose network weights differ from the checkpoint's (a
        :class:`~posthoc.PosteriorFileError`), so a posterior is never applied to another checkpoint.

        Args:
            checkpoint_path: the checkpoint (``callback.checkpoint_path``).
            module_cls: the ``LightningModule`` class; ``module_cls.load_from_checkpoint`` builds it.
            model_attr: as given to the callback.
            posterior_path: the posterior file (default :meth:`posterior_path_for` of the checkpoint).
            **load_options: passed to ``load_from_checkpoint``: constructor arguments the checkpoint's
                hyperparameters lack, ``map_location`` (Lightning puts the weights back on the device they were
                saved from where it exists, else on the CPU; the fitted model follows them).

        Example:
            >>> import lightning.pytorch as pl
            >>> from posthoc_apps.lightning import PosthocCallback
            >>> PosthocCallback.restore("missing.ckpt", pl.LightningModule)
            Traceback (most recent call last):
            posthoc.errors.PosteriorFileError: checkpoint missing.ckpt does not exist; ...
        """
        if not Path(checkpoint_path).exists():
            raise PosteriorFileError(
                f"checkpoint {checkpoint_path} does not exist; pass the checkpoint the callback "
                "fitted on (callback.checkpoint_path)"
            )
        module = module_cls.load_from_checkpoint(checkpoint_path, **load_options)
        posterior = PosthocCallback.posterior_path_for(checkpoint_path) if posterior_path is None else posterior_path
        return load(posterior, network_of(module, model_attr))

    # ------------------------------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the network, the method's structure on it and the loaders it needs, before the trainer runs."""
        stage = _name(stage)
        if stage not in self.stages:
            return
        self.uncertain_model = self.posterior_path = self.checkpoint_path = None
        chain = chain_of(self._wrap(network_of(pl_module, self.model_attr)).method)
        fitted = [method for method in chain if method.requires_fit]
        what = f"method {'+'.join(self.methods)}"
        if any(method.needs_val for method in fitted) and _source(trainer, stage, "val") is None:
            raise InputError(
                f"{what} is fitted on held-out data, and the trainer has no validation loader: give the "
                "datamodule (or the module) a val_dataloader, pass val_dataloaders= to the trainer, or "
                "choose a method fitted on the training data (method='laplace')"
            )
        if any(not method.needs_val for method in fitted) and _source(trainer, stage, "train") is None:
            raise InputError(
                f"{what} is fitted on the training data, and the trainer has no training loader: give "
                "the datamodule (or the module) a train_dataloader, or choose a method fitted on held-out "
                "data only (method='temperature')"
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Fit at the end of ``trainer.fit``: here the network is still on its device (``on_fit_end`` comes after
        Lightning moved it to the CPU) and every checkpoint of the run is written."""
        if "fit" in self.stages:
            self._fit(trainer, pl_module, "fit")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Fit at the end of ``trainer.validate`` (not of the validation rounds inside ``trainer.fit``)."""
        if "validate" in self.stages and _name(trainer.state.fn) == "validate" and not trainer.sanity_checking:
            self._fit(trainer, pl_module, "validate")

    # ------------------------------------------------------------------------------------------ the fit

    def _wrap(self, net: nn.Module) -> UncertainModel:
        return wrap(net, self.method, likelihood=self.likelihood, **self.options)

    def _loaders(self, trainer: pl.Trainer, stage: str) -> tuple[Any, Any]:
        """The training and validation loaders: those the trainer prepared for this call where it has them (sharded
        under DDP), else the ones its sources give."""
        prepared = {"train": trainer.train_dataloader if stage == "fit" else None, "val": trainer.val_dataloaders}
        loaders = []
        for kind in ("train", "val"):
            loader = prepared[kind]
            if loader is None and (source := _source(trainer, stage, kind)) is not None:
                loader = source.dataloader()
            loaders.append(_single(loader, f"{kind}_dataloader"))
        if distributed.active() and not all(_sharded(loader) for loader in loaders if loader is not None):
            # one whole loader means every rank fits alone on the whole data: a sharded one is read whole too
            loaders = [
                _single(_source(trainer, stage, kind).dataloader(), f"{kind}_dataloader")
                if _sharded(loader)
                else loader
                for loader, kind in zip(loaders, ("train", "val"))
            ]
        return loaders[0], loaders[1]

    def _checkpoint(self, trainer: pl.Trainer, stage: str) -> Path | None:
        """The checkpoint holding the weights to fit on: the best one after ``fit``, ``ckpt_path`` at ``validate``."""
        if stage == "validate":
            return None if trainer.ckpt_path is None else Path(trainer.ckpt_path)
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        return Path(best) if best else None

    def _network(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Path | None) -> nn.Module:
        """The network with the checkpoint's weights: the trained one if they are the same, else a copy."""
        net = network_of(pl_module, self.model_attr)
        if checkpoint is None:
            return net
        trainer.strategy.barrier("posthoc-checkpoint")  # rank 0 wrote it
        try:
            state = trainer.strategy.load_checkpoint(checkpoint)["state_dict"]
        except (OSError, KeyError, RuntimeError) as err:
            raise PosteriorFileError(
                f"could not read the weights of checkpoint {checkpoint} to fit posthoc on ({type(err).__name__}: {err})"
            ) from err
        prefix = "" if net is pl_module else f"{self._attr_of(pl_module, net)}."
        own = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
        live = net.state_dict()
        if own.keys() == live.keys() and all(torch.equal(live[key], own[key].to(live[key].device)) for key in live):
            return net
        fresh = copy.deepcopy(net)  # a LightningModule's copy leaves its trainer behind
        try:
            fresh.load_state_dict(own)
        except RuntimeError as err:
            raise PosteriorFileError(
                f"checkpoint {checkpoint} does not hold the weights of the network "
                f"{prefix.rstrip('.') or type(net).__name__}: {err}"
            ) from err
        return fresh

    @staticmethod
    def _attr_of(pl_module: nn.Module, net: nn.Module) -> str:
        return next(name for name, module in pl_module.named_modules() if module is net)

    def _fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        checkpoint = self._checkpoint(trainer, stage)
        if stage == "fit" and checkpoint is None and trainer.checkpoint_callback is not None:
            rank_zero_warn(
                "PosthocCallback: the ModelCheckpoint saved no checkpoint, so posthoc fits the trained "
                "weights and saves the posterior in default_root_dir; save the network to restore it"
            )
        train, val = self._loaders(trainer, stage)
        collective = distributed.active() and all(_sharded(loader) for loader in (train, val) if loader is not None)
        progress = trainer.progress_bar_callback is not None if self.progress is None else self.progress
        alone = contextlib.nullcontext() if collective else distributed.local_only()
        # trainer.validate runs its hooks under inference mode: tensors made there (the posterior's) could never be
        # updated or differentiated afterwards, and posthoc's fits need both
        with torch.inference_mode(False), torch.enable_grad():
            um = self._wrap(self._network(trainer, pl_module, checkpoint))
            with alone:
                um.fit(train, val, progress=progress, **self.fit_options)
        if self.path is not None:
            path = self.path
        elif checkpoint is not None:
            path = self.posterior_path_for(checkpoint)
        else:
            path = Path(trainer.default_root_dir) / DEFAULT_FILE
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            um.save(str(path))
        trainer.strategy.barrier("posthoc-saved")
        self.uncertain_model, self.posterior_path, self.checkpoint_path = um, path, checkpoint


__all__ = ["INSTALL_HINT", "PosthocCallback", "network_of"]
