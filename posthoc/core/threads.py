"""One CPU thread for small dense work, where torch's intra-op threads only wait on each other.

On a shared 2-core machine, ``eigh`` of a 520 x 520 curvature factor takes about 0.03 s on one
thread and 2-7 s on two, and vector scaling of 600 x 8 logits 0.2 s against 4.9 s.

Example:
    >>> matrix = torch.eye(520) + 0.01 * torch.ones(520, 520)
    >>> with single_thread_if(matrix.device.type == "cpu" and matrix.shape[0] <= 1024):
    ...     values, vectors = torch.linalg.eigh(matrix)
    >>> round(float(values.max()), 2)
    6.2
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: temporaries (bytes) below which a chunk of tensor work runs on one CPU thread: thread start-up and
#: barriers cost more than they save there (a last-layer predictive of 1,000 rows holds ~1 MB)
SMALL_WORK_BYTES = 4 * 2**20


@contextmanager
def single_thread_if(small: bool) -> Iterator[None]:
    """Run the block on one torch thread when ``small`` (and more than one is set), then restore the count."""
    previous = torch.get_num_threads()
    narrowed = small and previous > 1
    if narrowed:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if narrowed:
            torch.set_num_threads(previous)
