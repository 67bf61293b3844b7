"""Conformal sets for many classes: class-conditional and clustered (Ding et al. 2023), against the marginal sets
on the class-conditional coverage gap, and the clustering against TorchCP's ``ClusteredPredictor``.

The problem: 100 classes, half easy and half hard (the true class's logit is raised by 3 or by 1), 10 to 50
calibration examples per class. A marginal threshold over-covers the easy classes and under-covers the hard ones;
one threshold per class is right on average but noisy with so few examples; clusters pool the classes that score
alike (with 10 examples in the rarest class, the paper's rule makes two clusters from five examples per class).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torchcp.classification.predictor import ClusteredPredictor
from torchcp.classification.score import LAC

import posthoc
from posthoc.guarantees.bounds import minimum_calibration_size
from posthoc.guarantees.class_conditional import cluster_classes, cluster_thresholds, clustering_plan
from posthoc.guarantees.measures import class_coverage_gap, coverage

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = 100
BOOST = torch.tensor([3.0, 1.0], dtype=torch.float64).repeat(CLASSES // 2)


def draw(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Logits ``(N, 100)`` of examples of ``labels``: noise, the true class raised by its group's boost."""
    logits = torch.randn(len(labels), CLASSES, generator=generator, dtype=torch.float64)
    return logits.scatter_add(1, labels[:, None], BOOST[labels][:, None])


def calibration_labels(generator: torch.Generator) -> torch.Tensor:
    """10 to 50 calibration examples of each class (a count per class drawn uniformly)."""
    counts = torch.randint(10, 51, (CLASSES,), generator=generator)
    return torch.repeat_interleave(torch.arange(CLASSES), counts)


def test_clustered_sets_beat_the_marginal_ones_on_the_class_coverage_gap() -> None:
    generator, alpha, splits = torch.Generator().manual_seed(0), 0.1, 20
    test_labels = torch.arange(CLASSES).repeat(100)  # the test noise of a class's coverage: about 0.03
    gaps = {"marginal": [], "class": [], "cluster": []}
    covered = {"marginal": [], "class": [], "cluster": []}
    for split in range(splits):
        labels = calibration_labels(generator)
        logits = draw(labels, generator)
        test = posthoc.Prediction.from_probs(draw(test_labels, generator).softmax(-1))
        for condition in gaps:
            cp = posthoc.conformal(logits, labels, alpha=alpha, condition=condition, seed=split)
            result = cp.coverage(test, test_labels)
            gaps[condition].append(result["class_coverage_gap"])
            covered[condition].append(result["coverage"])
    gap = {condition: float(np.mean(values)) for condition, values in gaps.items()}
    # marginal: the easy classes near 1, the hard ones far below 0.9; clusters pool 50 classes each
    assert gap["cluster"] < 0.75 * gap["marginal"], gap
    assert gap["cluster"] < gap["class"], gap
    for condition, values in covered.items():  # each keeps the marginal guarantee (mean over 20 splits)
        assert np.mean(values) >= 1 - alpha - 0.01, (condition, np.mean(values))


def test_one_threshold_per_class_covers_every_class() -> None:
    generator, alpha = torch.Generator().manual_seed(1), 0.2
    labels = torch.arange(CLASSES).repeat(20)
    test_labels = torch.arange(CLASSES).repeat(40)
    per_class = []
    for _ in range(60):
        cp = posthoc.conformal(draw(labels, generator), labels, alpha=alpha, condition="class")
        sets = cp.score(draw(test_labels, generator).softmax(-1)) <= cp.threshold
        hit = sets.gather(1, test_labels[:, None]).squeeze(1).double()
        per_class.append(torch.zeros(CLASSES, dtype=torch.float64).index_add_(0, test_labels, hit) / 40)
    mean_per_class = torch.stack(per_class).mean(0)
    # 60 splits x 40 test points: a class's mean coverage has a standard error of about 0.02
    assert float(mean_per_class.min()) >= 1 - alpha - 0.07 and float(mean_per_class.mean()) >= 1 - alpha - 0.005


def test_the_clustering_and_thresholds_equal_torchcps() -> None:
    """TorchCP's random split and its k-means (random_state 2023) on the same LAC scores: the same partition of the
    classes and, for the classes it clusters, the same thresholds (TorchCP gives its null cluster an infinite
    threshold, posthoc the marginal one, as Ding et al. do)."""
    generator, alpha = torch.Generator().manual_seed(2), 0.1
    labels = calibration_labels(generator)
    logits = draw(labels, generator).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = ClusteredPredictor(LAC(), alpha=alpha)
        torch.manual_seed(0)
        reference.calculate_threshold(logits, labels)
    scores = 1 - logits.double().softmax(-1).gather(1, labels[:, None]).squeeze(1)
    clustering = reference.idx1.cpu()
    num_clusters, _ = clustering_plan(torch.bincount(labels, minlength=CLASSES), alpha)
    assert num_clusters == int(reference.num_clusters) >= 2
    ours = cluster_classes(scores[clustering], labels[clustering], CLASSES, alpha, num_clusters, random_state=2023)
    theirs = reference.cluster_assignments.cpu().long()
    assert torch.equal(ours == -1, theirs == -1)
    assert torch.equal(ours[:, None] == ours[None, :], theirs[:, None] == theirs[None, :])  # the same partition
    thresholds = cluster_thresholds(scores[~clustering], labels[~clustering], ours, alpha)
    kept = ours >= 0
    assert torch.allclose(thresholds[kept], reference.q_hat.cpu().double()[kept], atol=1e-6)
    assert (ours >= 0).sum() > 50  # most classes clustered: the comparison is not vacuous


def test_clustered_options_and_errors() -> None:
    generator = torch.Generator().manual_seed(3)
    labels = calibration_labels(generator)
    logits = draw(labels, generator)
    cp = posthoc.conformal(logits, labels, condition="cluster", alpha=0.1)
    assert cp.threshold.shape == (CLASSES,) and cp.clusters.shape == (CLASSES,) and "cluster" in repr(cp)
    assert posthoc.conformal(logits, labels, mondrian=True).condition == "class"
    with pytest.raises(posthoc.ConfigError, match="condition must be one of|unknown condition"):
        posthoc.conformal(logits, labels, condition="group")
    with pytest.raises(posthoc.ConfigError, match="contradicts condition='cluster'"):
        posthoc.conformal(logits, labels, mondrian=True, condition="cluster")
    few = torch.arange(CLASSES).repeat(5)
    with pytest.raises(posthoc.InputError, match="condition='cluster'"):
        posthoc.conformal(draw(few, generator), few, alpha=0.1, condition="class")
    assert minimum_calibration_size(0.1) == 9
    with pytest.raises(posthoc.InputError, match=r"\(N,\) per row|labels"):
        cp.coverage(logits, labels[:10])
    assert class_coverage_gap(cp.sets(logits), labels, 0.1) >= 0 and coverage(cp.sets(logits), labels) > 0.8
