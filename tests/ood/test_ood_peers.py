"""The activation-shaping, head-geometry, class-profile, NNGuide, OpenMax and relative Mahalanobis OOD scores against
pytorch-ood's detectors on one small model built here, and their errors.

Tolerance: the model runs in float32 on both sides; each pair computes the same float32 (or float64) arithmetic in a
different order, so the scores agree to a relative 1e-5 (an absolute 1e-5 on scores near 0).
"""

from __future__ import annotations

import copy

import pytest
import torch
from pytorch_ood import detector as pood
from sklearn.metrics.pairwise import cosine_similarity
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.engine.head import FeatureSplit

CLASSES, WIDTH, TRAIN = 4, 24, 800


@pytest.fixture(scope="module")
def problem():
    """An MLP with rectified features, training inputs labelled by it (one in ten labels flipped), test inputs half
    from the training law and half far from it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES)).eval()
    x = torch.randn(TRAIN, 6)
    x_test = torch.cat([torch.randn(60, 6), 4 * torch.randn(40, 6)])
    with torch.no_grad():  # every class predicted about as often
        model[2].bias -= model(x).mean(0)
    split = FeatureSplit(model)
    with torch.no_grad():
        phi, logits = split(x)
        phi_test, logits_test = split(x_test)
    flipped = torch.rand(TRAIN) < 0.1
    y = torch.where(flipped, torch.randint(0, CLASSES, (TRAIN,)), logits.argmax(-1))
    return {
        "model": model,
        "head": model[2],
        "x": x,
        "y": y,
        "x_test": x_test,
        "phi": phi,
        "logits": logits,
        "phi_test": phi_test,
        "logits_test": logits_test,
        "loader": DataLoader(TensorDataset(x, y), batch_size=128),
    }


def ours(problem, name, **options):
    det = posthoc.detector(problem["model"], score=name, **options)
    if det.requires_fit:
        det.fit(problem["loader"], progress=False)
    return det.score(problem["x_test"])


def close(mine, theirs, atol=1e-5):
    torch.testing.assert_close(mine.double(), torch.as_tensor(theirs).double(), rtol=1e-5, atol=atol)


def maps(features):
    """Features as pytorch-ood's feature maps ``(N, D, 1, 1)``."""
    return features[:, :, None, None]


def head_of_maps(problem):
    return lambda feature_maps: problem["head"](feature_maps.flatten(1))


@pytest.mark.parametrize("variant", ["p", "b", "s"])
@pytest.mark.parametrize("percentile", [0.65, 0.9])
def test_ash_equals_pytorch_ood(problem, variant, percentile):
    theirs = pood.ASH(None, head_of_maps(problem), variant=f"ash-{variant}", percentile=percentile)
    close(
        ours(problem, "ash", variant=variant, percentile=percentile),
        theirs.predict_feature_maps(maps(problem["phi_test"])),
    )


@pytest.mark.parametrize("percentile", [0.65, 0.9])
def test_scale_equals_pytorch_ood(problem, percentile):
    theirs = pood.SCALE(None, head_of_maps(problem), percentile=percentile)
    close(ours(problem, "scale", percentile=percentile), theirs.predict_feature_maps(maps(problem["phi_test"])))


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_lts_equals_pytorch_ood(problem, p):
    close(ours(problem, "lts", p=p), pood.LTS(None, problem["head"], p=p).predict_features(problem["phi_test"]))


@pytest.mark.parametrize("clip_quantile", [0.5, 0.9])
def test_react_equals_pytorch_oods_threshold_and_scores(problem, clip_quantile):
    theirs = pood.ReAct(None, head_of_maps(problem), percentile=clip_quantile)
    theirs.fit_feature_maps(maps(problem["phi"]), problem["y"])
    det = posthoc.detector(problem["model"], score="react", clip_quantile=clip_quantile)
    det.fit(problem["loader"], progress=False)
    assert det._scores["react"].threshold.item() == pytest.approx(theirs.threshold, rel=1e-6)
    close(det.score(problem["x_test"]), theirs.predict_feature_maps(maps(problem["phi_test"])))


@pytest.mark.parametrize("sparsity", [0.3, 0.7, 0.9])
def test_dice_equals_pytorch_ood(problem, sparsity):
    head = problem["head"]
    theirs = pood.DICE(None, head.weight, head.bias, p=sparsity).fit_features(problem["phi"], problem["y"])
    close(ours(problem, "dice", sparsity=sparsity), theirs.predict_features(problem["phi_test"]))


@pytest.mark.parametrize("k", [1, 10, 50])
def test_nnguide_equals_pytorch_ood(problem, k):
    theirs = pood.NNGuide(None, problem["head"], k=k).fit_features(problem["phi"], problem["y"])
    close(ours(problem, "nnguide", k=k), theirs.predict_features(problem["phi_test"]))


def test_fdbd_equals_pytorch_ood(problem):
    theirs = pood.fDBD(None, problem["head"]).fit_features(problem["phi"])
    close(ours(problem, "fdbd"), theirs.predict_features(problem["phi_test"]))


@pytest.mark.parametrize("alpha", [0.0, 0.05])
def test_nci_equals_pytorch_ood(problem, alpha):
    theirs = pood.NCI(None, problem["head"], alpha=alpha).fit_features(problem["phi"])
    close(ours(problem, "nci", alpha=alpha), theirs.predict_features(problem["phi_test"]))


def test_she_equals_pytorch_ood(problem):
    theirs = pood.SHE(None, problem["head"]).fit_features(problem["phi"], problem["y"])
    close(ours(problem, "she"), theirs.predict_features(problem["phi_test"]))


def test_kl_matching_equals_pytorch_ood(problem):
    theirs = pood.KLMatching(None).fit_logits(problem["logits"])
    close(ours(problem, "kl-matching"), theirs.predict_logits(problem["logits_test"]))


def test_relative_mahalanobis_is_n_times_pytorch_oods_rmd(problem):
    """pytorch-ood's covariances are the unnormalised scatters (plus 1e-6 I): its distances are ours over N. The
    difference of two distances cancels digits, so both sides run in float64 (float32 agrees only to ~1e-2)."""
    model = copy.deepcopy(problem["model"]).double()
    with torch.no_grad():
        phi, _ = FeatureSplit(model)(problem["x"].double())
        phi_test, _ = FeatureSplit(model)(problem["x_test"].double())
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # pytorch-ood allocates its means and covariance in the default dtype
    try:
        theirs = pood.RMD(None).fit_features(phi, problem["y"]).predict_features(phi_test)
    finally:
        torch.set_default_dtype(default)
    det = posthoc.detector(model, score="relative-mahalanobis").fit([(problem["x"].double(), problem["y"])])
    close(det.score(problem["x_test"].double()), theirs * TRAIN)


@pytest.mark.parametrize("revised, euclidean_weight", [(1, 1.0), (CLASSES, 1.0), (2, 0.5)])
def test_openmax_equals_pytorch_ood_fitted_on_the_correctly_classified(problem, revised, euclidean_weight):
    correct = problem["logits"].argmax(-1) == problem["y"]
    assert problem["logits_test"].argmax(-1).unique().numel() == CLASSES  # pytorch-ood's distances need every class
    theirs = pood.OpenMax(None, tailsize=20, alpha=revised, euclid_weight=euclidean_weight)
    # in float64: pytorch-ood's float32 logits shifted by 10000 keep only ~1e-3 of the tail distances
    theirs.fit_logits(problem["logits"][correct].double(), problem["y"][correct])
    mine = ours(problem, "openmax", tailsize=20, revised=revised, euclidean_weight=euclidean_weight)
    close(mine, theirs.predict_logits(problem["logits_test"].double()))


def test_max_cosine_is_the_largest_cosine_to_a_class_vector_negated(problem):
    cosines = cosine_similarity(problem["phi_test"].numpy(), problem["head"].weight.detach().numpy())
    close(ours(problem, "max-cosine"), -cosines.max(-1))


def test_the_new_scores_rank_far_inputs_as_more_ood(problem):
    """On this model the inputs four times farther out than the training law are OOD by every score but those whose
    sign or shaping ranks larger activations as more in-distribution (the energies of reshaped features, NNGuide's
    energy, SHE) or that reads an alignment this untrained head lacks (NCI)."""
    names = ["kl-matching", "openmax", "relative-mahalanobis", "max-cosine", "fdbd"]
    det = posthoc.detector(problem["model"], score=names).fit(problem["loader"], progress=False)
    scores = det.scores(problem["x_test"])
    for name in names:
        assert scores[name][60:].mean() > scores[name][:60].mean(), name


# ------------------------------------------------------------------------------------------- errors


def test_scores_that_need_training_statistics_refuse_to_score_before_fit(problem):
    for name in ("react", "dice", "nnguide", "fdbd", "nci", "she", "kl-matching", "openmax", "relative-mahalanobis"):
        with pytest.raises(posthoc.NotFittedError, match="detector.fit"):
            posthoc.detector(problem["model"], score=name).score(problem["x_test"])


def test_openmax_without_enough_correct_examples_of_a_class_says_how_many(problem):
    x, y = problem["x"][:100], problem["y"][:100]
    with pytest.raises(posthoc.InputError, match=r"tailsize=30 distances per class .* have only \[\d+"):
        posthoc.detector(problem["model"], score="openmax", tailsize=30).fit([(x, y)], progress=False)


def test_she_needs_a_correctly_classified_example_of_every_class(problem):
    x, y = problem["x"][:40], problem["y"][:40]
    wrong = (problem["logits"][:40].argmax(-1) + 1) % CLASSES
    with pytest.raises(posthoc.InputError, match="classifies none of class"):
        posthoc.detector(problem["model"], score="she").fit([(x, wrong)], progress=False)
    assert y.numel() == 40


def test_labelled_scores_refuse_a_loader_without_labels(problem):
    for name in ("she", "openmax", "relative-mahalanobis"):
        with pytest.raises(posthoc.InputError, match="without labels"):
            posthoc.detector(problem["model"], score=name).fit([problem["x"]], progress=False)


def test_a_percentile_that_keeps_no_activation_is_refused(problem):
    with pytest.raises(posthoc.ConfigError, match="keeps none of the 24 features"):
        ours(problem, "ash", percentile=0.99)
    with pytest.raises(posthoc.ConfigError, match="variant"):
        posthoc.detector(problem["model"], score="ash", variant="q")
