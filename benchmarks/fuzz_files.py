"""Damaged posthoc files at length: every load either reproduces the saved object exactly or is a PosteriorFileError.

A real posterior (last-layer Laplace on a small MLP) and a real calibrator (vector scaling) are saved,
then loaded back after damage: cut at every offset, every byte flipped, random bytes (bare, and behind
a zip header), and the odd paths (a directory, symbolic links to a file, to a folder, dangling and in
a loop, an empty file, a file of the other kind). Each load is counted as ``same`` (loaded and equal to
the original, tensor for tensor), ``refused`` (a :class:`~posthoc.PosteriorFileError`) or ``WRONG``
(loaded but different, or any other exception); the run fails if any is ``WRONG``.

The same checks run, bounded to a few seconds, in ``tests/core/test_files.py``.

Run: ``python benchmarks/fuzz_files.py [--random 2000]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import posthoc

#: what a damaged file is loaded as: the kind of file and how its loaded object's tensors are read
KINDS = ("posterior", "calibrator")


def originals(folder: Path) -> dict[str, tuple[Path, Callable[[Path], dict[str, torch.Tensor]]]]:
    """Save one posterior and one calibrator under ``folder``; for each kind, its path and a loader
    returning the loaded object's tensors (which a correct load reproduces exactly)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x, y = torch.randn(48, 4), torch.randint(0, 3, (48,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        um = posthoc.wrap(model, method="laplace", prior_precision=1.0).fit([(x, y)], progress=False)
        calibrator = posthoc.calibrate(torch.randn(60, 3) * 2, torch.arange(60) % 3, method="vector")
    posterior, saved_calibrator = folder / "posterior.pt", folder / "calibrator.pt"
    um.save(posterior)
    calibrator.save(saved_calibrator)

    def load_posterior(path: Path) -> dict[str, torch.Tensor]:
        return dict(posthoc.load(path, model).method.posterior_state())

    def load_calibrator(path: Path) -> dict[str, torch.Tensor]:
        return dict(posthoc.calibrate.load(path).named_buffers())

    return {"posterior": (posterior, load_posterior), "calibrator": (saved_calibrator, load_calibrator)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two tensor dicts are equal: same names, dtypes, shapes and values (NaN equal to NaN)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k].nan_to_num(), b[k].nan_to_num())
        for k in a
    )


def outcome(load: Callable[[Path], dict[str, torch.Tensor]], path: Path, expected: dict[str, torch.Tensor]) -> str:
    """``"same"``, ``"refused"`` or ``"WRONG: ..."`` for loading ``path`` (see the module docs)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = load(path)
    except posthoc.PosteriorFileError as err:
        return "refused" if str(path) in str(err) else f"WRONG: the error does not name the path: {err}"
    except Exception as err:  # noqa: BLE001  (any other exception is what this fuzz looks for)
        return f"WRONG: {type(err).__name__}: {err}"
    return "same" if same(loaded, expected) else "WRONG: loaded different tensors"


def truncated(data: bytes, offset: int) -> bytes:
    """The first ``offset`` bytes."""
    return data[:offset]


def flipped(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    """``data`` with the byte at each position XOR-ed with its mask (positions taken modulo the length)."""
    damaged = bytearray(data)
    for position, mask in flips:
        damaged[position % len(damaged)] ^= mask
    return bytes(damaged)


def odd_paths(folder: Path, originals_: dict[str, Path]) -> dict[str, Path]:
    """Paths that are not a posthoc file of the kind asked: a folder, symbolic links, an empty file, another pickle."""
    paths = {
        "directory": folder / "a_folder",
        "empty file": folder / "empty.pt",
        "a list": folder / "list.pt",
        "dangling link": folder / "dangling.pt",
        "link loop": folder / "loop.pt",
        "link to a folder": folder / "to_folder.pt",
    }
    paths["directory"].mkdir(exist_ok=True)
    paths["empty file"].write_bytes(b"")
    torch.save([1, 2, 3], paths["a list"])
    if hasattr(os, "symlink"):
        paths["dangling link"].symlink_to(folder / "missing.pt")
        paths["link loop"].symlink_to(paths["link loop"])
        paths["link to a folder"].symlink_to(paths["directory"], target_is_directory=True)
    for kind, path in originals_.items():
        paths[f"the {kind} file"] = path
    return {name: path for name, path in paths.items() if path.exists() or path.is_symlink()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random", type=int, default=2000, help="random files per kind (half behind a zip header)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    wrong: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        saved = originals(folder)
        damaged = folder / "damaged.pt"

        def check(kind: str, case: str, path: Path) -> None:
            source, load = saved[kind]
            result = outcome(load, path, load(source))
            counts[f"{kind}: {case}"][result.split(":")[0]] += 1
            if result.startswith("WRONG"):
                wrong.append(f"{kind}, {case}: {result}")

        odd = odd_paths(folder, {kind: source for kind, (source, _) in saved.items()})
        for kind, (source, load) in saved.items():
            data, expected = source.read_bytes(), load(source)
            for name, make in (
                ("cut at every offset", lambda k: truncated(data, k)),
                ("every byte flipped", lambda k: flipped(data, [(k, 0xFF)])),
                ("every byte with one bit flipped", lambda k: flipped(data, [(k, 1 << (k % 8))])),
            ):
                for k in range(len(data)):
                    damaged.write_bytes(make(k))
                    result = outcome(load, damaged, expected)
                    counts[f"{kind}: {name}"][result.split(":")[0]] += 1
                    if result.startswith("WRONG"):
                        wrong.append(f"{kind}, {name}, {k}: {result}")
            for k in range(args.random):
                body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 4096)))
                damaged.write_bytes((b"PK\x03\x04" if k % 2 else b"") + body)
                check(kind, "random bytes", damaged)
            for name, path in odd.items():
                check(kind, name, path)
    width = max(map(len, counts))
    for case, counter in counts.items():
        print(f"{case:<{width}}  " + "  ".join(f"{key} {value}" for key, value in sorted(counter.items())))
    for line in wrong[:20]:
        print(line)
    print(f"{sum(sum(c.values()) for c in counts.values())} loads, {len(wrong)} wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
