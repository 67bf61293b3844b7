"""OOD detectors (posthoc.detector) against pytorch-ood, OOD metrics against scikit-learn / torchmetrics /
pytorch-ood, sign and monotonicity, errors, evaluate(ood_scores=), the histogram figure, torch.distributed."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from pytorch_ood import detector as pood
from pytorch_ood.metrics import functional as pood_metrics
from sklearn.metrics import auc, precision_recall_curve, roc_auc_score
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset
from torchmetrics.functional.classification import binary_roc

import posthoc
from posthoc import settings
from posthoc.core.prediction import Prediction
from posthoc.engine.head import FeatureSplit
from posthoc.evaluation import metrics
from posthoc.ood.base import Outputs
from posthoc.ood.detector import SCORES, available_scores
from posthoc.ood.logits import Energy, MaxLogit
from posthoc.ood.predictive import GeneralizedEntropy, MaxSoftmax, PredictiveEntropy
from posthoc_apps.cli.evaluate import add_evaluate_arguments, run_evaluate
from posthoc_apps.demo import data
from posthoc_apps.report import figures, ood_plots
from posthoc_apps.report import page as html_page

sys.path.insert(0, str(Path(__file__).parent))
import _ood_dist_worker  # noqa: E402
from test_recipes import _digits_factory, image_folders  # noqa: E402,F401  (the recipes' image folders fixture)

CLASSES, WIDTH = 4, 12


@pytest.fixture(scope="module")
def problem():
    """A small MLP built here, its training and test inputs, labels of every class, and its features."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)).eval()
    x = torch.randn(400, 6)
    y = torch.arange(400) % CLASSES
    x_test = torch.cat([torch.randn(60, 6), 4 * torch.randn(40, 6)])
    with torch.no_grad():
        phi, logits = FeatureSplit(model)(x)
        phi_test, logits_test = FeatureSplit(model)(x_test)
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    return {
        "model": model,
        "x": x,
        "y": y,
        "x_test": x_test,
        "phi": phi,
        "phi_test": phi_test,
        "logits_test": logits_test,
        "loader": loader,
    }


def close(ours, theirs, rtol=1e-5):
    torch.testing.assert_close(ours.double(), theirs.double().to(ours.device), rtol=rtol, atol=1e-6)


# ------------------------------------------------------------------------------- pytorch-ood agreement


@pytest.mark.parametrize(
    "name, theirs",
    [
        ("msp", lambda logits: pood.MaxSoftmax.score(logits)),
        ("max-logit", lambda logits: pood.MaxLogit.score(logits)),
        ("energy", lambda logits: pood.EnergyBased.score(logits, t=1.0)),
        ("entropy", lambda logits: pood.Entropy.score(logits)),
    ],
)
def test_logit_scores_equal_pytorch_ood(problem, name, theirs):
    ours = posthoc.detector(problem["model"], score=name).score(problem["x_test"])
    assert ours.shape == (100,)
    close(ours, theirs(problem["logits_test"]))


def test_energy_temperature_is_pytorch_oods_t(problem):
    ours = posthoc.detector(problem["model"], score="energy", temperature=2.5).score(problem["x_test"])
    close(ours, pood.EnergyBased.score(problem["logits_test"], t=2.5))


@pytest.mark.parametrize("top", [None, 2])
def test_gen_is_pytorch_oods_mean_times_the_classes_it_averages(problem, top):
    """GEN sums the paper's terms; pytorch-ood averages them over the top M (and clamps p, inactive here)."""
    ours = posthoc.detector(problem["model"], score="gen", top=top, gamma=0.1).score(problem["x_test"])
    theirs = pood.GEN.score(problem["logits_test"], gamma=0.1, M=top)
    close(ours, theirs * (top or CLASSES))


def test_mahalanobis_is_twice_n_times_pytorch_oods_half_distance(problem):
    """pytorch-ood: half the squared distance under the unnormalised scatter (N Sigma + 1e-6 I)."""
    det = posthoc.detector(problem["model"], score="mahalanobis").fit(problem["loader"], progress=False)
    theirs = pood.Mahalanobis(None).fit_features(problem["phi"], problem["y"]).predict_features(problem["phi_test"])
    close(det.score(problem["x_test"]), theirs * 2 * len(problem["y"]))


def test_vim_equals_pytorch_ood_with_the_same_principal_dimension(problem):
    det = posthoc.detector(problem["model"], score="vim", dim=6).fit(problem["loader"], progress=False)
    head = problem["model"][2]
    theirs = pood.ViM(None, d=6, w=head.weight, b=head.bias).fit_features(problem["phi"], problem["y"])
    assert det._scores["vim"].alpha.item() == pytest.approx(theirs.alpha, rel=1e-5)
    close(det.score(problem["x_test"]), theirs.predict_features(problem["phi_test"]))


def test_vim_default_dimension_is_the_vim_repositorys_rule(problem):
    det = posthoc.detector(problem["model"], score="vim").fit(problem["loader"], progress=False)
    assert det._scores["vim"].residual_space.shape == (WIDTH, WIDTH - WIDTH // 2)


@pytest.mark.parametrize("k", [1, 5, 50])
def test_knn_equals_pytorch_ood_on_normalised_features(problem, k):
    det = posthoc.detector(problem["model"], score="knn", k=k).fit(problem["loader"], progress=False)
    theirs = pood.KNN(None, k=k).fit_features(problem["phi"], problem["y"]).predict_features(problem["phi_test"])
    close(det.score(problem["x_test"]), theirs)


def test_knn_in_bank_chunks_equals_one_chunk(problem):
    whole = posthoc.detector(problem["model"], score="knn", k=7).fit(problem["loader"], progress=False)
    chunked = posthoc.detector(problem["model"], score="knn", k=7, max_memory=4 * 100 * 3).fit(
        problem["loader"], progress=False
    )
    torch.testing.assert_close(chunked.score(problem["x_test"]), whole.score(problem["x_test"]), rtol=0, atol=0)


def test_every_score_from_one_detector_equals_its_own_detector_and_chunks_do_not_matter(problem):
    names = [name for name in available_scores() if name != "mutual-information"]
    options = {"k": 5, "tailsize": 5}  # (random labels: a few correct examples of a class for OpenMax's tail)
    together = posthoc.detector(problem["model"], score=names, **options).fit(problem["loader"], progress=False)
    with settings.override(chunk_size=7):
        chunked = together.scores(problem["x_test"])
    for name in names:
        accepted = SCORES[name].option_defaults()
        alone = posthoc.detector(problem["model"], score=name, **{k: v for k, v in options.items() if k in accepted})
        alone.fit(problem["loader"], progress=False)
        torch.testing.assert_close(chunked[name], alone.score(problem["x_test"]), rtol=1e-6, atol=1e-6)


def test_fit_streams_batches_one_example_at_a_time_as_well_as_all_at_once(problem):
    names = ["mahalanobis", "vim", "knn"]
    x, y = problem["x"], problem["y"]
    ones = posthoc.detector(problem["model"], score=names, k=5).fit(
        DataLoader(TensorDataset(x, y), batch_size=1), progress=False
    )
    whole = posthoc.detector(problem["model"], score=names, k=5).fit([(x, y)], progress=False)
    for name in names:
        torch.testing.assert_close(
            ones.score(problem["x_test"], name), whole.score(problem["x_test"], name), rtol=1e-5, atol=1e-6
        )


def test_a_wrapped_model_gives_its_predictive_to_the_probability_scores(digits_model, small):
    um = posthoc.wrap(digits_model, method="mc-dropout", num_samples=8).fit(progress=False)
    det = posthoc.detector(um, score=["entropy", "mutual-information", "msp", "energy"])
    x = small["x"][:40]
    got = det.scores(x, generator=torch.Generator().manual_seed(3))
    pred = um.predict(x, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(got["entropy"], pred.entropy)
    torch.testing.assert_close(got["mutual-information"], pred.epistemic)
    torch.testing.assert_close(got["msp"], -pred.confidence)
    assert bool((got["mutual-information"] > 0).all())
    torch.testing.assert_close(got["energy"], -torch.logsumexp(digits_model(x), -1))


# ---------------------------------------------------------------------------------- sign, monotonicity


def test_every_score_ranks_held_out_digits_and_noise_as_more_ood(digits_model, loaders, small):
    um = posthoc.wrap(digits_model, method="mc-dropout", num_samples=4).fit(progress=False)
    det = posthoc.detector(um, score=available_scores(), k=10).fit(small["fit"], progress=False)
    on_test = det.score_loader(loaders["test"], progress=False, generator=torch.Generator().manual_seed(0))
    on_ood = det.score_loader(loaders["ood"], progress=False, generator=torch.Generator().manual_seed(0))
    noise = det.scores(torch.rand(300, 1, 28, 28, generator=torch.Generator().manual_seed(0)))
    for name in available_scores():
        assert metrics.ood_auroc(on_test[name], on_ood[name]) > 0.75, name
        assert metrics.ood_auroc(on_test[name], noise[name]) > 0.6, name


def test_a_more_confident_top_logit_lowers_every_logit_score():
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(1))
    top = logits.argmax(-1)
    for step in (0.5, 1.0, 3.0):
        raised = logits.clone()
        raised[torch.arange(50), top] += step
        for score in (
            MaxSoftmax(),
            PredictiveEntropy(),
            MaxLogit(),
            Energy(temperature=2.0),
            GeneralizedEntropy(top=None),
        ):
            before = score(Outputs(logits=logits, prediction=Prediction.from_log_probs(logits.log_softmax(-1))))
            after = score(Outputs(logits=raised, prediction=Prediction.from_log_probs(raised.log_softmax(-1))))
            assert bool((after < before).all()), (score.name, step)


def test_mahalanobis_grows_along_a_ray_away_from_the_training_features(problem):
    det = posthoc.detector(problem["model"], score=["mahalanobis", "vim"]).fit(problem["loader"], progress=False)
    phi = problem["phi"]
    direction = torch.randn(WIDTH, generator=torch.Generator().manual_seed(2))
    steps = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
    features = phi.mean(0) + steps[:, None] * phi.std(0) * direction
    head = problem["model"][2]
    outputs = Outputs(features=features, logits=head(features).detach(), head=head)
    distances = det._scores["mahalanobis"](outputs)
    assert bool((distances.diff() > 0).all())


# ------------------------------------------------------------------------------------------- errors


def test_scores_that_need_statistics_refuse_to_score_before_fit(problem):
    for name in ("mahalanobis", "vim", "knn"):
        with pytest.raises(posthoc.NotFittedError, match="detector.fit"):
            posthoc.detector(problem["model"], score=name).score(problem["x_test"])


def test_non_finite_training_statistics_are_refused_at_fit(problem, monkeypatch):
    """Finite features can still give a non-finite statistic (a covariance that overflows in low precision): the fit
    refuses it instead of keeping a bank that scores NaN."""
    monkeypatch.setattr(torch.linalg, "pinv", lambda matrix, **kwargs: torch.full_like(matrix, float("nan")))
    with pytest.raises(
        posthoc.NumericalError,
        match=r"'mahalanobis' computed non-finite training statistics \(precision "
        r"holds NaN or inf\)",
    ):
        posthoc.detector(problem["model"], score="mahalanobis").fit(problem["loader"], progress=False)


def test_a_model_whose_feature_width_changed_since_fit_is_refused(problem):
    model = nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)).eval()
    det = posthoc.detector(model, score="mahalanobis").fit(problem["loader"], progress=False)
    model[0] = nn.Linear(6, 5)  # surgery on the same head module: it now reads 5 features
    model[2].weight = nn.Parameter(torch.randn(CLASSES, 5))
    with pytest.raises(posthoc.InputError, match="receives 5 features but the detector was fitted on 12"):
        det.score(problem["x_test"])


def test_bad_names_and_options_fail_with_the_valid_ones(problem):
    model = problem["model"]
    with pytest.raises(posthoc.ConfigError, match="valid scores: msp, max-logit, energy"):
        posthoc.detector(model, score="odin")
    with pytest.raises(posthoc.ConfigError, match="unknown option"):
        posthoc.detector(model, score="energy", k=5)
    with pytest.raises(posthoc.ConfigError, match="temperature"):
        posthoc.detector(model, score="energy", temperature=0)
    with pytest.raises(posthoc.ConfigError, match="needs a posterior"):
        posthoc.detector(model, score="mutual-information")
    with pytest.raises(posthoc.ConfigError, match="name one"):
        posthoc.detector(model, score=["energy", "msp"]).score(problem["x_test"])
    with pytest.raises(posthoc.ConfigError, match="not computed by this detector"):
        posthoc.detector(model, score="energy").scores(problem["x_test"], ["knn"])
    with pytest.raises(posthoc.ConfigError, match="0 < dim < the feature width 12"):
        posthoc.detector(model, score="vim", dim=12).fit(problem["loader"], progress=False)
    with pytest.raises(posthoc.InputError, match="k=500 exceeds the 400 training examples"):
        posthoc.detector(model, score="knn", k=500).fit(problem["loader"], progress=False)
    with pytest.raises(posthoc.InputError, match="without labels"):
        posthoc.detector(model, score="mahalanobis").fit([problem["x"]], progress=False)
    with pytest.raises(posthoc.InputError, match="NaN"):
        posthoc.detector(model, score="energy").score(torch.full((2, 6), float("nan")))


# ------------------------------------------------------------------------------------------ metrics


def test_ood_metrics_equal_sklearn_torchmetrics_and_pytorch_ood_with_ties():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        inside = torch.randn(int(torch.randint(5, 300, (1,), generator=generator)), generator=generator).round(
            decimals=1
        )
        outside = (torch.randn(int(torch.randint(5, 300, (1,), generator=generator)), generator=generator) + 1).round(
            decimals=1
        )
        scores = torch.cat([inside, outside])
        is_ood = np.r_[np.zeros(len(inside)), np.ones(len(outside))]
        labels = torch.cat([torch.zeros(len(inside)), -torch.ones(len(outside))]).long()
        precision, recall, _ = precision_recall_curve(is_ood, scores.numpy())
        assert metrics.aupr(inside, outside, "out") == pytest.approx(auc(recall, precision), abs=1e-12)
        precision, recall, _ = precision_recall_curve(1 - is_ood, -scores.numpy())
        assert metrics.aupr(inside, outside, "in") == pytest.approx(auc(recall, precision), abs=1e-12)
        assert metrics.aupr(inside, outside, "in") == pytest.approx(
            float(pood_metrics.aupr(scores, labels, "id")), abs=1e-12
        )
        fpr, tpr, _ = binary_roc(scores, torch.as_tensor(is_ood).long())
        expected = float(fpr[torch.searchsorted(tpr.double(), torch.tensor([0.95], dtype=torch.float64))[0]])
        assert metrics.fpr_at_tpr(inside, outside) == pytest.approx(expected, abs=1e-7)
        assert metrics.fpr_at_tpr(inside, outside) == pytest.approx(
            float(pood_metrics.fpr_at_tpr(scores, labels)), abs=1e-12
        )
        assert metrics.ood_metrics(inside, outside)["auroc"] == pytest.approx(roc_auc_score(is_ood, scores.numpy()))


def test_ood_metrics_refuse_empty_sets_and_nan():
    with pytest.raises(posthoc.InputError, match="at least one"):
        metrics.fpr_at_tpr(torch.tensor([]), torch.tensor([1.0]))
    with pytest.raises(posthoc.InputError, match="NaN"):
        metrics.aupr(torch.tensor([float("nan")]), torch.tensor([1.0]))


# ------------------------------------------------------------------------------- evaluate and plots


def test_evaluate_reports_detector_scores_next_to_the_methods_entropy(digits_model, digits, small, tmp_path):
    loaders = {name: data.loader(data.subset(getattr(digits, name), 300), batch_size=100) for name in ("test", "ood")}
    um = posthoc.wrap(digits_model, method="none")
    det = posthoc.detector(digits_model, score=["energy", "knn", "entropy"], k=10).fit(small["fit"], progress=False)
    report = posthoc.evaluate(um, loaders["test"], loaders["ood"], ood_scores=det, progress=False)
    assert list(report.ood) == ["entropy", "energy", "knn"]
    assert report.ood["entropy"]["auroc"] == pytest.approx(report.ood_auroc)
    assert set(report.ood["knn"]) == {"auroc", "aupr_in", "aupr_out", "fpr95"}
    assert report.as_dict()["ood"] == report.ood
    table = report.ood_to_markdown()
    assert table.count("\n") == 4 and "| none | knn |" in table and "FPR@95TPR" in table
    by_name = posthoc.evaluate(
        um, loaders["test"], loaders["ood"], ood_scores=["energy"], progress=False, ci=0.9, bootstraps=100
    )
    assert by_name.ood["energy"] == pytest.approx(report.ood["energy"])
    low, high = by_name.intervals["ood_auroc:energy"]
    assert low < by_name.ood["energy"]["auroc"] < high
    assert (
        f"| none | energy | {by_name.ood['energy']['auroc']:.4f} [{low:.4f}, {high:.4f}] |" in by_name.ood_to_markdown()
    )
    assert (
        html_page.html_view(by_name).count("data:image/png;base64,") == 3
    )  # reliability, risk-coverage, OOD histograms
    tempered = posthoc.wrap(digits_model, method="temperature").fit(val_loader=small["val"], progress=False)
    own = posthoc.evaluate(
        tempered, loaders["test"], loaders["ood"], ood_scores=["msp", "gen", "energy"], progress=False
    )
    scorer = posthoc.detector(tempered, score=["msp", "gen"])  # the predictive's scores, from a pass of their own
    on_test, on_ood = (scorer.score_loader(loaders[name], progress=False) for name in ("test", "ood"))
    for name in ("msp", "gen"):  # evaluate takes them from the predictions it made: the same numbers
        assert own.ood[name] == pytest.approx(metrics.ood_metrics(on_test[name], on_ood[name]))
    with pytest.raises(posthoc.ConfigError, match="pass ood_loader"):
        posthoc.evaluate(um, loaders["test"], ood_scores=["energy"], progress=False)
    with pytest.raises(posthoc.ConfigError, match="need training statistics"):
        posthoc.evaluate(um, loaders["test"], loaders["ood"], ood_scores=["mahalanobis"], progress=False)
    figures.ood_histograms(report, tmp_path / "ood.png")
    assert 10_000 < (tmp_path / "ood.png").stat().st_size < 1_000_000
    assert posthoc.evaluate(um, loaders["test"], progress=False).ood is None


def test_histogram_figure_has_one_panel_per_score_with_both_sets():
    generator = torch.Generator().manual_seed(0)
    values = {
        name: (torch.randn(100, generator=generator), torch.randn(80, generator=generator) + 1)
        for name in ("energy", "knn", "vim", "msp", "gen")
    }
    fig = ood_plots.ood_histograms(values)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title().split("\n")[0] for ax in panels] == list(values)
    assert all(len(ax.containers) == 2 for ax in panels)
    assert [t.get_text() for t in panels[0].get_legend().get_texts()] == ["in-distribution", "OOD"]
    assert len(fig.axes) == 8  # two rows of four, three hidden


# ----------------------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_with_uneven_shards_fit_the_statistics_of_their_union(tmp_path, digits_model, digits):
    context = mp.start_processes(
        _ood_dist_worker.run, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 180
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("distributed workers did not finish within 180 s (hang?)")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    union = DataLoader(ConcatDataset(_ood_dist_worker.shards(digits.fit)), batch_size=64)
    single = posthoc.detector(digits_model, score=_ood_dist_worker.SCORES, k=10).fit(union, progress=False)
    expected = single.scores(digits.test.tensors[0][:50])
    for name in _ood_dist_worker.SCORES:
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        # the same sums in another order: float64 statistics, float32 scores (ViM's is a difference of two ~10s)
        torch.testing.assert_close(ranks[0][name], expected[name], rtol=1e-5, atol=1e-4, msg=name)


# ------------------------------------------------------------------------------------------------ CLI


def test_evaluate_cli_reports_ood_scores_of_the_plain_model_next_to_each_methods_entropy(image_folders, tmp_path):  # noqa: F811
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    out = tmp_path / "report"
    args = parser.parse_args(
        [
            "--model",
            f"{_digits_factory(tmp_path)}:digits",
            "--train",
            str(image_folders["train"]),
            "--val",
            str(image_folders["val"]),
            "--ood",
            str(image_folders["ood"]),
            "--ood-scores",
            "energy,knn,mahalanobis,entropy",
            "--ood-option",
            "k=5",
            "--method",
            "temperature",
            "--workers",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    run_evaluate(args)
    report = (out / "report.md").read_text()
    rows = json.loads((out / "metrics.json").read_text())["rows"]
    assert list(rows[0]["test"]["ood"]) == ["entropy", "energy", "knn", "mahalanobis"]
    assert rows[1]["test"]["ood"]["knn"] == rows[0]["test"]["ood"]["knn"]  # one detector of the plain model
    assert "| none | mahalanobis |" in report and "best post-hoc: " in report
    # temperature's own row, or the note that it kept T = 1 and was merged into the plain model's
    assert "| temperature | " in report or "`temperature` into `none` (its temperature kept T = 1)" in report
    assert (out / "ood_scores.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "x", "--val", "v", "--out", "o", "--ood-scores", "energy,odin"])
    args.train = None
    with pytest.raises(posthoc.ConfigError, match="reads training statistics: pass --train"):
        run_evaluate(args)


def test_vim_takes_a_second_pass_only_when_the_features_exceed_its_memory(problem):
    batches = list(problem["loader"])
    served = []

    class Counting:
        def __len__(self):
            return len(batches)

        def __iter__(self):
            for batch in batches:
                served.append(1)
                yield batch

    kept = posthoc.detector(problem["model"], score="vim", dim=6).fit(Counting(), progress=False)
    assert len(served) == len(batches)
    streamed = posthoc.detector(problem["model"], score="vim", dim=6, max_memory=1000).fit(Counting(), progress=False)
    assert len(served) == 3 * len(batches)
    torch.testing.assert_close(streamed.score(problem["x_test"]), kept.score(problem["x_test"]), rtol=1e-6, atol=1e-6)
