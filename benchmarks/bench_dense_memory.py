"""Dense sampling under the memory budget: MC dropout (S=50) on 512 x 512 maps of 21 classes.

One map's 50 samples are 50 x 21 x 512 x 512 float32 = 1,101 MB, twice the default ``max_memory`` (512 MiB), so
``DenseModel.predict`` draws them in groups that fit it (``_predict_in_sample_groups``). The network is a random
fully convolutional one (a 3x3 conv, ReLU, dropout, a 1x1-conv head to 21 classes): its weights do not matter for
memory. Prints the peak growth of the resident set over ``predict`` on 2 maps (large blocks forced to ``mmap``, as
in ``bench_imagenet_shape.py``) beside what holding the S samples of one map would take, and the time beside a plain
forward.

Run: ``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=1048576 python benchmarks/bench_dense_memory.py``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_imagenet_shape import MiB, peak_growth  # noqa: E402

import posthoc  # noqa: E402

SIZE, CLASSES, SAMPLES, MAPS = 512, 21, 50, 2


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Dropout(0.2), nn.Conv2d(16, CLASSES, 1)).eval()
    images = torch.randn(MAPS, 3, SIZE, SIZE)
    masks = torch.randint(0, CLASSES, (MAPS, SIZE, SIZE))
    um = posthoc.wrap(model, method="mc-dropout", dense=True, p=0.2, num_samples=SAMPLES)
    um.fit(None, [(images[:1], masks[:1])], progress=False)
    with torch.no_grad():
        start = time.perf_counter()
        model(images)
        plain = time.perf_counter() - start
    start = time.perf_counter()
    peak = peak_growth(lambda: um.predict(images, generator=torch.Generator().manual_seed(0)), "cpu")
    seconds = time.perf_counter() - start
    one_map = SAMPLES * CLASSES * SIZE * SIZE * 4
    outputs = 4 * MAPS * SIZE * SIZE * (CLASSES + 5)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, max_memory {posthoc.settings.max_memory // MiB} MiB"
    )
    print("| what | MiB |\n|---|---:|")
    print(f"| S={SAMPLES} samples of one {SIZE}x{SIZE} map of {CLASSES} classes | {one_map / MiB:,.0f} |")
    print(f"| the returned prediction ({MAPS} maps: probs and five fields) | {outputs / MiB:,.0f} |")
    print(f"| peak growth over predict | {peak / MiB:,.0f} |")
    print(f"\npredict {seconds:.1f} s; plain forward {plain:.2f} s ({seconds / plain:.0f}x: {SAMPLES} samples)")


if __name__ == "__main__":
    main()
