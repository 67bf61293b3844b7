"""``"ivon"``: a short IVON fine-tune from the checkpoint, Gaussian weight samples at predict (see :mod:`.method`)."""

from posthoc.methods.ivon.method import IVON  # noqa: F401
