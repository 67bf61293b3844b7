"""Collecting SWAG statistics from weight snapshots, inside any training loop (public as ``posthoc.SWAGCollector``).

:class:`SWAGCollector` keeps, for a chosen set of parameters flattened into one vector, the running mean and the sum
of squared deviations (Welford's algorithm in float64), and a ring buffer of the last ``rank`` deviations
``theta_i - mean_i`` (the low-rank part of SWAG). Call ``collector.update(model)`` after the optimizer steps that
count as snapshots, as ``torch.optim.swa_utils.AveragedModel.update_parameters`` is called.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.methods.swag.collector import SWAGCollector
    >>> model = nn.Linear(4, 3)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> collector = SWAGCollector(model, rank=4)
    >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    >>> for step in range(8):
    ...     optimizer.zero_grad()
    ...     nn.functional.cross_entropy(model(x), y).backward()
    ...     optimizer.step()
    ...     if step % 2 == 1:
    ...         collector.update(model)
    >>> collector.num_snapshots, collector.num_deviations
    (4, 4)
    >>> theta = collector.sample(scale=0.5, generator=torch.Generator().manual_seed(0))
    >>> weights = collector.unflatten(theta, like=model)          # {name: tensor}
    >>> torch.func.functional_call(model, weights, (x,)).shape    # the model under one SWAG sample
    torch.Size([32, 3])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from posthoc.errors import ConfigError, InputError, NumericalError

ParameterSource = nn.Module | Mapping[str, Tensor]


def _named_tensors(source: ParameterSource) -> dict[str, Tensor]:
    if isinstance(source, nn.Module):
        return dict(source.named_parameters())
    if isinstance(source, Mapping):
        return dict(source)
    raise InputError(f"update takes an nn.Module or a dict of tensors, got {type(source).__name__}")


class SWAGCollector(nn.Module):
    """First and second moments plus a low-rank deviation buffer of a set of parameters, collected in your own loop.

    Call :meth:`update` after each optimizer step that counts as a snapshot; :meth:`sample` then draws SWAG weights
    ``mean + sqrt(scale) * (sigma * z1 + D^T z2 / sqrt(K - 1))`` and :meth:`unflatten` names them for
    ``torch.func.functional_call``. ``names`` defaults to every parameter of ``source`` (a model or a ``{name: tensor}``
    dict) with ``requires_grad``; ``rank`` (``>= 2``) is how many of the latest deviations are kept (``low_rank=False``:
    none, SWAG-diagonal); ``stats_device`` defaults to the parameters' device. The statistics are buffers (``count``,
    ``mean``, ``sum_sq``, ``deviation_rows``), so ``state_dict`` saves them.
    """

    def __init__(
        self,
        source: ParameterSource,
        *,
        names: Iterable[str] | None = None,
        rank: int = 20,
        low_rank: bool = True,
        stats_device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 2:
            raise ConfigError(f"rank must be an integer >= 2 (the low-rank part needs two deviations), got {rank!r}")
        tensors = _named_tensors(source)
        if names is None:
            names = [name for name, tensor in tensors.items() if tensor.requires_grad]
        self.names = list(names)
        missing = [name for name in self.names if name not in tensors]
        if missing:
            raise ConfigError(f"no parameter(s) named {missing}; available: {sorted(tensors)[:30]}")
        if not self.names:
            raise ConfigError(
                "no parameters to collect: every parameter is frozen (requires_grad=False) or none was named"
            )
        self.shapes = [tuple(tensors[name].shape) for name in self.names]
        self.numels = [math.prod(shape) for shape in self.shapes]
        device = torch.device(stats_device) if stats_device is not None else tensors[self.names[0]].device
        size = sum(self.numels)
        self.register_buffer("count", torch.zeros((), dtype=torch.long, device=device))
        self.register_buffer("mean", torch.zeros(size, dtype=torch.float64, device=device))
        self.register_buffer("sum_sq", torch.zeros(size, dtype=torch.float64, device=device))
        rows = torch.zeros(rank, size, dtype=torch.float32, device=device) if low_rank else None
        self.register_buffer("deviation_rows", rows)
        self._float_moments: tuple[tuple, Tensor, Tensor] | None = None

    @property
    def num_parameters(self) -> int:
        return sum(self.numels)

    @property
    def rank(self) -> int:
        """The most deviations the low-rank buffer keeps (0 without one)."""
        return 0 if self.deviation_rows is None else self.deviation_rows.shape[0]

    @property
    def low_rank(self) -> bool:
        return self.deviation_rows is not None

    @property
    def num_snapshots(self) -> int:
        """How many snapshots were averaged into the mean."""
        return int(self.count)

    @property
    def num_deviations(self) -> int:
        """``K``: how many deviations the ring buffer holds now (``min(snapshots, rank)``)."""
        return min(self.num_snapshots, self.rank) if self.low_rank else 0

    def flatten(self, source: ParameterSource) -> Tensor:
        """The collected parameters of ``source`` as one float64 vector on the statistics device."""
        tensors = _named_tensors(source)
        try:
            parts = [tensors[name].detach().reshape(-1) for name in self.names]
        except KeyError as err:
            raise InputError(
                f"the model has no parameter {err}; pass the same model the collector was built on"
            ) from None
        device = self.mean.device
        return torch.cat([part.to(device=device, dtype=torch.float64) for part in parts])

    def unflatten(self, flat: Tensor, like: ParameterSource | None = None) -> dict[str, Tensor]:
        """Split a flat vector into ``{name: tensor}``; with ``like``, on its devices and dtypes."""
        tensors = _named_tensors(like) if like is not None else {}
        out = {}
        for name, shape, part in zip(self.names, self.shapes, flat.split(self.numels)):
            target = tensors.get(name)
            part = part.reshape(shape)
            out[name] = part if target is None else part.to(device=target.device, dtype=target.dtype)
        return out

    @torch.no_grad()
    def update(self, source: ParameterSource) -> None:
        """Add the current parameters of ``source`` as one snapshot (refuses NaN/inf weights)."""
        theta = self.flatten(source)
        if not torch.isfinite(theta).all():
            raise NumericalError(
                f"the weights hold NaN or inf after {self.num_snapshots} good snapshot(s); the snapshot was "
                "not added (lower the learning rate)"
            )
        self.count += 1
        delta = theta - self.mean
        self.mean += delta / self.count
        self.sum_sq += delta * (theta - self.mean)
        if self.deviation_rows is not None:
            row = (self.num_snapshots - 1) % self.rank
            self.deviation_rows[row] = (theta - self.mean).to(self.deviation_rows.dtype)

    @property
    def variance(self) -> Tensor:
        """The population variance of the snapshots, per coordinate (float64)."""
        if self.num_snapshots == 0:
            raise NumericalError("no snapshot was collected yet; call update(model) first")
        return (self.sum_sq / self.count).clamp_min(0.0)

    @property
    def deviations(self) -> Tensor:
        """The held deviations ``(K, P)``, oldest first."""
        if self.deviation_rows is None:
            raise ConfigError("this collector was built with low_rank=False; it keeps no deviations")
        held = self.num_deviations
        if self.num_snapshots <= self.rank:
            return self.deviation_rows[:held]
        start = self.num_snapshots % self.rank
        return torch.cat([self.deviation_rows[start:], self.deviation_rows[:start]])

    @property
    def held_deviations(self) -> Tensor:
        """The held deviations ``(K, P)`` in storage order (no copy; the order does not matter for sampling)."""
        if self.deviation_rows is None:
            raise ConfigError("this collector was built with low_rank=False; it keeps no deviations")
        return self.deviation_rows[: self.num_deviations]

    def sample(
        self, *, scale: float = 0.5, generator: torch.Generator | None = None, low_rank: bool | None = None
    ) -> Tensor:
        """Draw ``theta = mean + sqrt(scale) * (sigma * z1 + D^T z2 / sqrt(K - 1))`` (float32, flat).

        ``low_rank=False`` drops the ``D`` term (SWAG-diagonal); ``scale=0`` returns the SWA mean.
        """
        low_rank = self.low_rank if low_rank is None else low_rank
        if low_rank and not self.low_rank:
            raise ConfigError("low-rank sampling needs a collector built with low_rank=True")
        if self.num_snapshots == 0:
            raise NumericalError("no snapshot was collected yet; call update(model) first")
        if scale == 0:
            return self.mean.float()
        held = self.num_deviations if low_rank else self.num_snapshots
        if held < 2:
            raise NumericalError(
                f"SWAG needs at least 2 snapshots to sample, it holds {held}; collect more (more epochs, "
                "a higher collect_per_epoch, or count the pretrained weights as a snapshot)"
            )
        mean, std = self._mean_and_std()
        z1 = torch.randn(self.num_parameters, generator=generator, device=mean.device)
        theta = std * z1
        if low_rank:
            z2 = torch.randn(held, generator=generator, device=mean.device)
            theta += (z2 @ self.held_deviations) / math.sqrt(held - 1)
        return mean + math.sqrt(scale) * theta

    def _mean_and_std(self) -> tuple[Tensor, Tensor]:
        """float32 mean and standard deviation, reused across samples until the statistics change."""
        cached = self._float_moments
        fresh = (
            cached is not None
            and cached[0][0] is self.mean
            and cached[0][1] is self.sum_sq
            and cached[0][2:] == (self.mean._version, self.sum_sq._version)
        )
        if not fresh:  # holding the tensors themselves rules out a stale match after buffers are replaced
            key = (self.mean, self.sum_sq, self.mean._version, self.sum_sq._version)
            self._float_moments = (key, self.mean.float(), self.variance.sqrt().float())
        return self._float_moments[1], self._float_moments[2]

    def extra_repr(self) -> str:
        return f"parameters={self.num_parameters}, rank={self.rank}, snapshots={self.num_snapshots}"
