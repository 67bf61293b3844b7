"""Pictures of dense predictions: for a few inputs, the input, the label map, the predicted map, the error and the
uncertainty map (the predictive entropy), side by side, one row per input; given a mask (for example
``posthoc.risk_control(...).mask(probs)``), a sixth column shows it.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.segmentation import segmentation_data, trained_fcn, loaders
    >>> from posthoc_apps.report.dense_maps import dense_maps
    >>> data = segmentation_data(train=64, val=32, test=8)
    >>> um = posthoc.wrap(trained_fcn(data.train, epochs=1), method="temperature", dense=True)
    >>> um = um.fit(None, loaders(data)[1], progress=False)
    >>> images, masks = data.test.tensors
    >>> fig = dense_maps(images[:3], um.predict(images[:3]), masks[:3], "maps.png")
    >>> len(fig.axes)
    15
"""

from __future__ import annotations

from matplotlib.figure import Figure
from torch import Tensor

from posthoc.core.prediction import Prediction

#: the columns of :func:`dense_maps`
COLUMNS = ("input", "label", "prediction", "error", "uncertainty (entropy)")
#: the column of a given mask
MASK_COLUMN = "mask"


def dense_maps(
    images: Tensor,
    prediction: Prediction,
    labels: Tensor,
    path: str | None = None,
    *,
    ignore_index: int = 255,
    mask: Tensor | None = None,
) -> Figure:
    """Draw :data:`COLUMNS` for each input of ``images`` ``(n, channels, H, W)`` (a segmentation map's prediction
    ``(n, C, H, W)`` and labels ``(n, H, W)``), and :data:`MASK_COLUMN` from ``mask`` ``(n, H, W)`` (bool) when
    given; ignored positions are grey in the label and the error. Saved to ``path`` as a PNG when given."""
    n = images.shape[0]
    columns = (*COLUMNS, MASK_COLUMN) if mask is not None else COLUMNS
    figure = Figure(figsize=(2.2 * len(columns), 2.2 * n))
    axes = figure.subplots(n, len(columns), squeeze=False)
    classes = prediction.probs.shape[1]
    for row in range(n):
        ignored = labels[row] == ignore_index
        label = labels[row].float().masked_fill(ignored, float("nan"))
        error = (prediction.label[row] != labels[row]).float().masked_fill(ignored, float("nan"))
        image = images[row].float()
        panels = (
            (image[0] if image.shape[0] == 1 else image.permute(1, 2, 0), "gray", None),
            (label, "tab20", (0, classes - 1)),
            (prediction.label[row].float(), "tab20", (0, classes - 1)),
            (error, "Reds", (0, 1)),
            (prediction.entropy[row].float(), "magma", None),
            *(() if mask is None else ((mask[row].float(), "Blues", (0, 1)),)),
        )
        for column, (values, cmap, limits) in enumerate(panels):
            ax = axes[row, column]
            low, high = limits or (None, None)
            ax.imshow(values.cpu().numpy(), cmap=cmap, vmin=low, vmax=high, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(columns[column], fontsize=9)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=100)
    return figure
