"""``"label-shift"``: the predictive reweighted for the deployment's class priors (estimated by BBSE or EM)."""

from posthoc.methods.label_shift.method import LabelShift

__all__ = ["LabelShift"]
