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

import math
from collections.abc import Sequence

from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from torch import Tensor

from posthoc.core.prediction import Prediction
from posthoc_apps.report.plots import InlineFigure

#: the columns of :func:`dense_maps`
COLUMNS = ("input", "label", "prediction", "error", "entropy (0 to ln C)")
#: the column of a given mask
MASK_COLUMN = "mask"
#: the colour of ignored positions in the label and the error
IGNORED = "#b0b0b0"


def class_colours(classes: int) -> ListedColormap:
    """One colour per class: class 0 (the background, as in torchvision's maps) near white, the others tab10's
    colours (tab20's beyond ten), ignored positions (nan) grey.

    Example:
        >>> from posthoc_apps.report.dense_maps import class_colours
        >>> class_colours(11).N
        11
    """
    palette = colormaps["tab10" if classes <= 11 else "tab20"]
    colours = ["#f4f4f4", *(palette(k % palette.N) for k in range(classes - 1))]
    return ListedColormap(colours).with_extremes(bad=IGNORED)


def dense_maps(
    images: Tensor,
    prediction: Prediction,
    labels: Tensor,
    path: str | None = None,
    *,
    ignore_index: int = 255,
    mask: Tensor | None = None,
    input_range: tuple[float, float] | None = None,
    class_names: Sequence[str] | None = None,
) -> Figure:
    """Draw :data:`COLUMNS` for each input of ``images`` ``(n, channels, H, W)`` (a segmentation map's prediction
    ``(n, C, H, W)`` and labels ``(n, H, W)``), and :data:`MASK_COLUMN` from ``mask`` ``(n, H, W)`` (bool) when
    given. Every row shares one scale per column, so that rows (and figures) compare: the input on ``input_range``
    (a one-channel image's values; default the batch's range), the entropy from 0 to ``ln C``. Ignored positions are
    grey in the label and the error; ``class_names`` adds a legend of the class colours. Saved to ``path`` as a PNG
    when given."""
    n = images.shape[0]
    columns = (*COLUMNS, MASK_COLUMN) if mask is not None else COLUMNS
    figure = InlineFigure(figsize=(2.2 * len(columns), 2.2 * n + (0.5 if class_names else 0.0)))
    axes = figure.subplots(n, len(columns), squeeze=False)
    classes = prediction.probs.shape[1]
    colours, errors = class_colours(classes), colormaps["Reds"].with_extremes(bad=IGNORED)
    grey = input_range or (float(images.min()), float(images.max()))
    for row in range(n):
        ignored = labels[row] == ignore_index
        label = labels[row].float().masked_fill(ignored, float("nan"))
        error = (prediction.label[row] != labels[row]).float().masked_fill(ignored, float("nan"))
        image = images[row].float()
        panels = (
            (image[0], "gray", grey) if image.shape[0] == 1 else (image.permute(1, 2, 0), None, (None, None)),
            (label, colours, (-0.5, classes - 0.5)),
            (prediction.label[row].float(), colours, (-0.5, classes - 0.5)),
            (error, errors, (0, 1)),
            (prediction.entropy[row].float(), "magma", (0.0, math.log(classes))),
            *(() if mask is None else ((mask[row].float(), "Blues", (0, 1)),)),
        )
        for column, (values, cmap, (low, high)) in enumerate(panels):
            ax = axes[row, column]
            ax.imshow(values.cpu().numpy(), cmap=cmap, vmin=low, vmax=high, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(columns[column], fontsize=9)
    if class_names:
        handles = [Patch(color=colours(k), label=name) for k, name in enumerate(class_names)]
        handles.append(Patch(color=IGNORED, label="ignored"))
        figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 12), fontsize=8, frameon=False)
        figure.tight_layout(rect=(0, 0.35 / figure.get_figheight(), 1, 1))
    else:
        figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=100)
    return figure
