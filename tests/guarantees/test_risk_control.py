"""``posthoc.risk_control``: the mean test FNR over many random splits, the threshold against MAPIE, and bad inputs.

Conformal risk control promises ``E[FNR_test] <= alpha`` over the calibration draw and the test example
(Angelopoulos et al. 2022, Theorem 1), and, when an example's loss moves in small steps, ``E[FNR_test] >=
alpha - 2/(n + 1)`` (Theorem 2; its jumps are ``1 / positives`` of an example). Each test below draws at least 200
calibration/test splits and checks the mean test FNR lies in ``[alpha - 2/(n + 1) - 3 SE, alpha + 3 SE]``, SE the
standard error of that mean over the splits (so the check fails about 0.3 % of the time by chance if the method is
right, and fails for a threshold off by a few hundredths, see ``test_a_looser_or_tighter_threshold_fails_the_check``).
Fresh draws per split for the synthetic models (the promise is over the draw); random permutations of one fixed pool
for the digits (the promise then holds conditionally on the pool, exchangeability being what it needs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import posthoc
from posthoc.guarantees.risk_control import crc_threshold, false_negative_rate, object_scores

pytestmark = pytest.mark.usefixtures("one_thread")

SPLITS = 300


def multilabel(
    shape: tuple[int, ...], generator: torch.Generator, labels: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores and 0/1 targets ``shape + (labels,)``: labels of prevalence 3 %..40 % (about a fifth of the
    examples have none), each example with its own noise level (some are hard), scores overconfident."""
    prevalence = torch.linspace(0.03, 0.4, labels, dtype=torch.float64)
    targets = (torch.rand(*shape, labels, generator=generator, dtype=torch.float64) < prevalence).long()
    noise = 0.5 + 2.0 * torch.rand(*shape, 1, generator=generator, dtype=torch.float64)
    logits = (
        2.0 * (2 * targets - 1)
        - 1.5 * prevalence.logit().neg().sqrt()
        + noise * torch.randn(*shape, labels, generator=generator, dtype=torch.float64)
    )
    return torch.sigmoid(1.5 * logits), targets


def segmentation_pool(count: int, generator: torch.Generator, size: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax maps ``(count, 3, size, size)`` and class maps ``(count, size, size)``: a rectangle of class 1 or 2 on
    background 0 in 85 % of images (none in the rest), a ring of unlabelled (255) pixels on a third of them, and
    logits that are the one-hot truth blurred, plus spatially smooth noise (errors come in blobs, as a network's do)."""
    labels = torch.zeros(count, size, size, dtype=torch.long)
    corners = torch.randint(0, size - 3, (count, 2), generator=generator)
    extents = torch.randint(2, 7, (count, 2), generator=generator)
    kinds = torch.randint(1, 3, (count,), generator=generator)
    present = torch.rand(count, generator=generator) < 0.85
    rows, cols = torch.arange(size)[None, :, None], torch.arange(size)[None, None, :]
    inside = (
        (rows >= corners[:, 0, None, None])
        & (rows < (corners[:, 0] + extents[:, 0])[:, None, None])
        & (cols >= corners[:, 1, None, None])
        & (cols < (corners[:, 1] + extents[:, 1])[:, None, None])
    )
    labels = torch.where(inside & present[:, None, None], kinds[:, None, None], labels)
    onehot = F.one_hot(labels, 3).permute(0, 3, 1, 2).double()
    noise = F.avg_pool2d(torch.randn(count, 3, size, size, generator=generator, dtype=torch.float64), 3, 1, 1)
    logits = 3.0 * F.avg_pool2d(onehot, 3, 1, 1) + 4.0 * noise
    ring = (torch.rand(count, generator=generator) < 0.33)[:, None, None] & ((rows == 0) | (cols == size - 1))
    return logits.softmax(1), labels.masked_fill(ring, 255)


def digits_pool() -> tuple[torch.Tensor, torch.Tensor]:
    """A binary map per sklearn digit: the ink (pixel > 6 of 16) as the object, scored by a per-pixel logistic
    regression on a noisy copy of the image (the pixel and its 3 x 3 mean), trained on the first 300 digits; the pool
    is the other 1,497."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    images = torch.from_numpy(load_digits().images)
    ink = (images > 6).long()
    rng = torch.Generator().manual_seed(0)
    noisy = images + 5.0 * torch.randn(images.shape, generator=rng, dtype=torch.float64)
    local = F.avg_pool2d(noisy[:, None], 3, 1, 1, count_include_pad=False)[:, 0]
    features = torch.stack([noisy, local], -1).reshape(-1, 2).numpy()
    fitted = LogisticRegression().fit(features[: 300 * 64], ink[:300].reshape(-1).numpy())
    probs = torch.from_numpy(fitted.predict_proba(features)[:, 1]).reshape(images.shape)
    return probs[300:], ink[300:]


def check_band(test_fnr: np.ndarray, alpha: float, n_cal: int) -> None:
    mean, se = test_fnr.mean(), test_fnr.std(ddof=1) / np.sqrt(len(test_fnr))
    lower = alpha - 2.0 / (n_cal + 1)
    assert lower - 3 * se <= mean <= alpha + 3 * se, (
        f"mean test FNR {mean:.4f} (SE {se:.4f}, {len(test_fnr)} splits) outside [{lower:.4f}, {alpha}] +- 3 SE"
    )


def pool_splits(
    probs, targets, n_cal: int, alpha: float, splits: int = SPLITS, seed: int = 0, shift: float = 0.0, **options
):
    """Test FNR of each of ``splits`` random calibration/test permutations of one pool (threshold moved by ``shift``)."""
    scores, layout = object_scores(probs, options.get("positive", "foreground"))
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(splits):
        order = torch.randperm(len(scores), generator=generator)
        cal, test = order[:n_cal], order[n_cal:]
        rc = posthoc.risk_control(probs[cal], targets[cal], alpha=alpha, **options)
        rc.threshold += shift
        out.append(float(rc.risk(probs[test], targets[test]).mean()))
    return np.array(out)


@pytest.mark.parametrize("alpha", [0.05, 0.2])
def test_multilabel_mean_fnr_over_fresh_splits(alpha: float) -> None:
    n_cal, n_test = 400, 400
    probs, targets = multilabel((SPLITS, n_cal + n_test), torch.Generator().manual_seed(7))
    thresholds = torch.tensor(
        [posthoc.risk_control(p[:n_cal], t[:n_cal], alpha=alpha).threshold for p, t in zip(probs, targets)]
    )
    test_probs, test_truth = probs[:, n_cal:], targets[:, n_cal:].bool()
    missed = (test_truth & (test_probs < thresholds[:, None, None])).sum(-1)
    fnr = (missed / test_truth.sum(-1).clamp_min(1)).mean(-1).double().numpy()  # vectorised over the splits
    check_band(fnr, alpha, n_cal)


@pytest.mark.parametrize("positive", ["foreground", 2])
def test_segmentation_mean_fnr_over_random_splits(positive) -> None:
    probs, labels = segmentation_pool(1500, torch.Generator().manual_seed(3))
    check_band(pool_splits(probs, labels, 500, 0.1, positive=positive), 0.1, 500)


def test_digits_ink_mask_mean_fnr_over_random_splits() -> None:
    probs, ink = digits_pool()
    check_band(pool_splits(probs, ink, 300, 0.05, splits=200), 0.05, 300)


def test_a_looser_or_tighter_threshold_fails_the_check() -> None:
    """The band is narrow enough to catch a threshold off by 0.03 either way (the check can fail)."""
    probs, ink = digits_pool()
    for shift in (-0.03, 0.03):
        with pytest.raises(AssertionError):
            check_band(pool_splits(probs, ink, 300, 0.05, splits=200, shift=shift), 0.05, 300)


def test_threshold_is_the_largest_that_meets_the_bound() -> None:
    probs, targets = multilabel((300,), torch.Generator().manual_seed(1))
    rc = posthoc.risk_control(probs, targets, alpha=0.1)
    n, truth = 300, targets.bool()

    def bound(t: float) -> float:
        return n / (n + 1) * float(false_negative_rate(probs >= t, truth).mean()) + 1 / (n + 1)

    assert bound(rc.threshold) <= 0.1 and abs(rc.bound - bound(rc.threshold)) < 1e-12
    above = probs[truth & (probs > rc.threshold)].min()  # the next true score: missing it breaks the bound
    assert bound(float(above)) > 0.1
    assert rc.lam == pytest.approx(1 - rc.threshold)


def test_numpy_in_numpy_out_and_prediction_input() -> None:
    probs, targets = multilabel((100,), torch.Generator().manual_seed(2))
    rc = posthoc.risk_control(probs.numpy(), targets.numpy(), alpha=0.1)
    assert rc.threshold == posthoc.risk_control(probs, targets, alpha=0.1).threshold
    assert isinstance(rc.mask(probs.numpy()), np.ndarray)


def test_no_object_anywhere_gives_an_empty_mask() -> None:
    probs = torch.rand(50, 4, 4)
    rc = posthoc.risk_control(probs, torch.zeros(50, 4, 4, dtype=torch.long), alpha=0.1)
    assert rc.threshold == float("inf") and not rc.mask(probs).any()


# -- against MAPIE ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "alpha"), [(0, 0.1), (1, 0.2), (2, 0.05)])
def test_multilabel_threshold_matches_mapie_crc(seed: int, alpha: float) -> None:
    """MAPIE's ``MultiLabelClassificationController(risk="recall", method="crc")`` searches a grid ``lambda`` (masks
    ``p > lambda``, bound ``< alpha``) and keeps the largest grid point below which every point meets the bound; our
    exact threshold (masks ``p >= t``, bound ``<= alpha``) must then lie in ``(lambda_M, lambda_M + step]``: the
    tolerance is the grid step, 0.01 (MAPIE's default grid)."""
    from mapie.risk_control import MultiLabelClassificationController

    probs, targets = multilabel((300,), torch.Generator().manual_seed(seed))
    keep = targets.sum(1) > 0  # MAPIE refuses examples without a label
    probs, targets = probs[keep].numpy(), targets[keep].numpy()
    mapie = MultiLabelClassificationController(
        predict_function=lambda x: x, risk="recall", method="crc", target_level=1 - alpha
    ).calibrate(probs, targets)
    lam = float(mapie.best_predict_param[0])
    ours = posthoc.risk_control(probs, targets, alpha=alpha).threshold
    assert lam < ours <= lam + 0.01 + 1e-12, (lam, ours)
    n, grid = len(probs), torch.from_numpy(mapie.predict_params)
    probs_t, truth = torch.from_numpy(probs), torch.from_numpy(targets).bool()
    ours_bound = torch.stack([false_negative_rate(probs_t > lam_g, truth).mean() for lam_g in grid]) * n / (n + 1)
    np.testing.assert_allclose(mapie.r_hat_plus, (ours_bound + 1 / (n + 1)).numpy(), atol=1e-12)  # the same loss


def test_binary_map_threshold_matches_mapie_segmentation() -> None:
    """MAPIE's ``SemanticSegmentationController`` on ``(N, 1, H, W)`` maps is the same computation; same tolerance."""
    from mapie.risk_control import SemanticSegmentationController

    probs, ink = digits_pool()
    probs, ink = probs[:250], ink[:250]
    mapie = SemanticSegmentationController(
        predict_function=lambda x: x, risk="recall", method="crc", target_level=0.9
    ).calibrate(probs[:, None].numpy(), ink[:, None].numpy())
    lam = float(mapie.best_predict_param[0])
    ours = posthoc.risk_control(probs, ink, alpha=0.1).threshold
    assert lam < ours <= lam + 0.01 + 1e-12, (lam, ours)


# -- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda p, t: posthoc.risk_control(p, t, alpha=0.0), "alpha"),
        (lambda p, t: posthoc.risk_control(p, t, alpha=1.5), "alpha"),
        (lambda p, t: posthoc.risk_control(p, t[:, :3], alpha=0.1), "do not match"),
        (lambda p, t: posthoc.risk_control(p[:5], t[:5], alpha=0.1), "at least 9 calibration"),
        (lambda p, t: posthoc.risk_control(p.logit(), t, alpha=0.1), "not logits"),
        (lambda p, t: posthoc.risk_control(p, t * 2, alpha=0.1), "must be 0 or 1"),
        (lambda p, t: posthoc.risk_control(p, t, alpha=0.1, loss="iou"), "loss"),
        (lambda p, t: posthoc.risk_control(p[:, 0], t[:, 0], alpha=0.1), "positions per example"),
        (
            lambda p, t: posthoc.risk_control(
                torch.rand(20, 3, 4, 4).softmax(1), torch.zeros(20, 4, 4).long(), alpha=0.1, positive=3
            ),
            "not a class",
        ),
    ],
)
def test_bad_input_names_the_fix(call, words: str) -> None:
    probs, targets = multilabel((50,), torch.Generator().manual_seed(4))
    with pytest.raises(posthoc.PosthocError, match=words):
        call(probs, targets)


def test_crc_threshold_handles_ties() -> None:
    scores = torch.tensor([[0.5, 0.5], [0.5, 0.9]] * 10, dtype=torch.float64)
    truth = torch.ones_like(scores, dtype=torch.bool)
    threshold, risk = crc_threshold(scores, truth, alpha=0.3)
    assert threshold == 0.5 and risk == 0.0  # dropping the 0.5s would miss 75 % of the positives
