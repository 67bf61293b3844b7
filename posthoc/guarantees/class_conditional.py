"""Thresholds per class for conformal sets: class-conditional (Mondrian) and clustered (Ding et al. 2023).

A marginal threshold covers ``1 - alpha`` on average over classes: easy classes get more, hard ones less. One
threshold per class (``condition="class"``, Vovk 2012) covers every class, but needs ``ceil(1/alpha - 1)`` calibration
examples of each, and with a few tens per class its thresholds are noisy, so each class's coverage scatters widely
around ``1 - alpha``.

Clustered conformal (Ding, Angelopoulos, Bates, Jordan & Tibshirani, "Class-Conditional Conformal Prediction with
Many Classes", NeurIPS 2023) pools classes whose scores look alike:

1. a random fraction of the calibration examples embeds each class by the 0.5, 0.6, 0.7, 0.8 and 0.9 quantiles of
   its true-class scores, and k-means (each class weighed by the square root of its count) groups the classes;
2. the other examples give one conformal threshold per cluster; classes with too few clustering examples (fewer
   than ``ceil(1/alpha - 1)``) form a null cluster that gets the marginal threshold.

The number of clusters and the clustering fraction follow the paper's rule (the same as TorchCP's ``"auto"``):
with ``n_min`` the smallest class count (at least ``ceil(1/alpha - 1)``) and ``m`` the classes that have it,
``n_clustering = floor(n_min * m / (75 + m))``, ``floor(n_clustering / 2)`` clusters and a fraction
``n_clustering / n_min``. Coverage then holds per cluster (for the classes of a cluster together); each class's
coverage is close to ``1 - alpha`` when the classes of a cluster share their score law.

Example:
    >>> import torch
    >>> from posthoc.guarantees.class_conditional import clustered_thresholds
    >>> g = torch.Generator().manual_seed(0)
    >>> labels = torch.arange(40).repeat(60)                         # 40 classes, 60 examples each
    >>> hard = (labels % 2).double()                                 # odd classes score higher
    >>> scores = torch.rand(2400, generator=g, dtype=torch.float64) * 0.5 + 0.5 * hard
    >>> thresholds, clusters = clustered_thresholds(scores, labels, 40, alpha=0.1, generator=g)
    >>> bool((thresholds[1::2] > thresholds[0::2]).all())            # the hard classes got the larger threshold
    True
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from posthoc.errors import InputError
from posthoc.guarantees.bounds import conformal_threshold, minimum_calibration_size

#: the score quantiles that embed a class for clustering (Ding et al. 2023)
EMBEDDING_QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9)


def per_class_thresholds(scores: Tensor, labels: Tensor, num_classes: int, alpha: float) -> Tensor:
    """One :func:`conformal_threshold` per class, from the calibration examples of that class ``(C,)``; every class
    needs :func:`minimum_calibration_size` of them.

    Example:
        >>> import torch
        >>> from posthoc.guarantees.class_conditional import per_class_thresholds
        >>> per_class_thresholds(torch.arange(20.0), torch.arange(20) % 2, 2, alpha=0.2)
        tensor([16., 17.])
    """
    counts = torch.bincount(labels, minlength=num_classes)
    short = [c for c in range(num_classes) if counts[c] < minimum_calibration_size(alpha)]
    if short:
        listing = ", ".join(f"class {c}: {int(counts[c])}" for c in short[:10]) + (", ..." if len(short) > 10 else "")
        raise InputError(
            f"class-conditional sets at alpha={alpha:g} need at least {minimum_calibration_size(alpha)} calibration "
            f"examples of every class; too few for {listing}. Add calibration data, raise alpha, or use "
            "condition='cluster' (pools classes that score alike) or the marginal sets"
        )
    return torch.stack([conformal_threshold(scores[labels == c], alpha) for c in range(num_classes)])


def clustering_plan(counts: Tensor, alpha: float) -> tuple[int, float]:
    """The paper's number of clusters and clustering fraction from the class counts ``(C,)`` (module docs).

    Example:
        >>> import torch
        >>> from posthoc.guarantees.class_conditional import clustering_plan
        >>> clustering_plan(torch.full((100,), 40), alpha=0.1)       # floor(40 * 100 / 175) = 22: 11 clusters
        (11, 0.55)
    """
    n_min = max(int(counts.min()), minimum_calibration_size(alpha))
    remaining = int((counts >= n_min).sum())
    n_clustering = int(n_min * remaining / (75 + remaining))
    return n_clustering // 2, n_clustering / n_min


def class_embeddings(scores: Tensor, labels: Tensor, classes: Tensor) -> Tensor:
    """Each class of ``classes`` embedded by the :data:`EMBEDDING_QUANTILES` of its scores ``(len(classes), 5)``: the
    ``ceil(count * q)``-th smallest score."""
    rows = []
    for c in classes.tolist():
        own = scores[labels == c]
        rows.append(torch.stack([own.kthvalue(math.ceil(len(own) * q)).values for q in EMBEDDING_QUANTILES]))
    return torch.stack(rows)


def cluster_classes(
    scores: Tensor, labels: Tensor, num_classes: int, alpha: float, num_clusters: int, random_state: int
) -> Tensor:
    """The cluster of each class ``(C,)``, ``-1`` for the null cluster, from the clustering examples' scores: k-means
    (scikit-learn, 10 starts) on the :func:`class_embeddings` of the classes with at least
    :func:`minimum_calibration_size` examples, each weighed by the square root of its count."""
    from sklearn.cluster import KMeans

    counts = torch.bincount(labels, minlength=num_classes)
    kept = torch.nonzero(counts >= minimum_calibration_size(alpha)).flatten()
    assignment = torch.full((num_classes,), -1, dtype=torch.long)
    if num_clusters < 2 or len(kept) <= num_clusters:
        return assignment
    embeddings = class_embeddings(scores, labels, kept).numpy()
    kmeans = KMeans(n_clusters=num_clusters, n_init=10, random_state=random_state)
    kmeans.fit(embeddings, sample_weight=np.sqrt(counts[kept].double().numpy()))
    assignment[kept] = torch.from_numpy(kmeans.labels_.astype(np.int64))
    return assignment


def cluster_thresholds(scores: Tensor, labels: Tensor, assignment: Tensor, alpha: float) -> Tensor:
    """The threshold of each class ``(C,)``: its cluster's conformal threshold over the examples of the cluster's
    classes (``inf``, the full set, for a cluster with fewer than :func:`minimum_calibration_size`); the null cluster
    ``-1`` takes the marginal threshold over all examples."""
    clusters = assignment[labels]
    thresholds = torch.empty(len(assignment), dtype=scores.dtype)
    for k in assignment.unique().tolist():
        own = scores if k == -1 else scores[clusters == k]
        enough = len(own) >= minimum_calibration_size(alpha)
        thresholds[assignment == k] = conformal_threshold(own, alpha) if enough else math.inf
    return thresholds


def clustered_thresholds(
    scores: Tensor, labels: Tensor, num_classes: int, alpha: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """The clustered thresholds ``(C,)`` and clusters ``(C,)`` (``-1``: the null cluster) of Ding et al. 2023 (module
    docs): a random fraction of the examples clusters the classes, the rest calibrates the clusters."""
    if len(scores) < minimum_calibration_size(alpha):
        raise InputError(
            f"clustered sets at alpha={alpha:g} need at least {minimum_calibration_size(alpha)} calibration "
            f"examples, got {len(scores)}; add calibration data or raise alpha"
        )
    num_clusters, fraction = clustering_plan(torch.bincount(labels, minlength=num_classes), alpha)
    clustering = torch.rand(len(scores), generator=generator, dtype=torch.float64) < fraction
    random_state = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    assignment = cluster_classes(scores[clustering], labels[clustering], num_classes, alpha, num_clusters, random_state)
    return cluster_thresholds(scores[~clustering], labels[~clustering], assignment, alpha), assignment
