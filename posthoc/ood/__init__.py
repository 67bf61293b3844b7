"""Post-hoc OOD detectors on a model's own logits, features and predictive: :func:`detector`.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> det = posthoc.detector(model, score=["energy", "vim"]).fit(train_loader)
    >>> det.scores(x)["vim"].shape
    torch.Size([8])
"""

from posthoc.ood.detector import Detector, available_scores, detector

__all__ = ["Detector", "available_scores", "detector"]
