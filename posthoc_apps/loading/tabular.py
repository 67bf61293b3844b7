"""Tabular data and saved models for ``posthoc evaluate --likelihood regression``: CSV files of numbers and a
``torch.save``'d (or TorchScript) ``nn.Module`` that takes a float feature matrix.

A CSV file has a header row; the ``targets`` columns are the regression targets ``y (N, D)`` and every other
column, in file order, is a feature of ``x (N, F)`` (or just the ``features`` named). Every cell must be a
number: the model sees the features as they are in the file, so preprocess them (standardise, encode
categories) the way the model was trained before writing the CSV.

Several files of one run (:func:`read_tables`) are matched by column name, never by position: every file is
read in the first file's feature order (or the ``features`` named), and a file that lacks one of its columns,
or has one it has not, is refused naming both files and the columns.

Example:
    >>> from pathlib import Path
    >>> import torch
    >>> from torch import nn
    >>> from posthoc_apps.loading.tabular import load_module, read_table, read_tables
    >>> _ = Path("train.csv").write_text("cylinders,displacement,mpg\\n4,97,31\\n8,350,15\\n6,232,19\\n")
    >>> _ = Path("test.csv").write_text("displacement,cylinders,mpg\\n140,4,25\\n318,8,14\\n")
    >>> table = read_table("test.csv", ["mpg"])
    >>> table.x.shape, table.y.shape, table.features
    (torch.Size([2, 2]), torch.Size([2, 1]), ['displacement', 'cylinders'])
    >>> train, test = read_tables(["train.csv", "test.csv"], ["mpg"])   # test's columns in train's order
    >>> test.features, test.x[0]
    (['cylinders', 'displacement'], tensor([  4., 140.]))
    >>> torch.save(nn.Linear(2, 1), "model.pt")
    >>> load_module("model.pt")
    Linear(in_features=2, out_features=1, bias=True)
"""

from __future__ import annotations

import csv
import os
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from posthoc.errors import InputError


@dataclass(frozen=True)
class Table:
    """Features ``x (N, F)`` and targets ``y (N, D)`` (float32) read from ``path``, with their column names."""

    path: Path
    x: Tensor
    y: Tensor
    features: list[str]
    targets: list[str]

    def __len__(self) -> int:
        return len(self.x)

    def rows(self, index: Tensor) -> Table:
        """The table of the rows ``index`` (e.g. one part of a split)."""
        return Table(self.path, self.x[index], self.y[index], self.features, self.targets)


def _number(text: str, path: Path, line: int, column: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InputError(
            f"{path}, line {line}, column {column!r}: {text!r} is not a number; every feature and target "
            "must be numeric (encode categories and drop text columns before writing the CSV)"
        ) from None


def read_table(path: str | os.PathLike, targets: Sequence[str], features: Sequence[str] | None = None) -> Table:
    """Read a CSV file into a :class:`Table`: ``targets`` columns as ``y``, ``features`` (default: all the others)
    as ``x``. Refuses a missing file or column, a non-numeric cell and a file without rows, naming them."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no CSV file at {path}; pass the path of a file with a header row")
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = [name.strip() for name in next(reader, [])]
        body = [row for row in reader if any(cell.strip() for cell in row)]
    doubled = sorted({name for name in header if header.count(name) > 1})
    if doubled:
        raise InputError(
            f"{path} names column(s) {doubled} more than once; columns are read by name, so give each a name of its own"
        )
    missing = [name for name in [*targets, *(features or [])] if name not in header]
    if missing:
        raise InputError(f"{path} has no column(s) {missing}; its columns: {', '.join(header) or '(none)'}")
    chosen = list(features) if features is not None else [name for name in header if name not in targets]
    if not chosen:
        raise InputError(f"{path} has no feature columns besides the target(s) {list(targets)}")
    if not body:
        raise InputError(f"{path} has a header but no rows")
    columns = {name: header.index(name) for name in header}
    values = []
    for line, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise InputError(f"{path}, line {line}: {len(row)} cells for {len(header)} columns")
        values.append([_number(row[columns[name]], path, line, name) for name in [*chosen, *targets]])
    matrix = torch.tensor(values, dtype=torch.float32)
    return Table(path, matrix[:, : len(chosen)], matrix[:, len(chosen) :], chosen, list(targets))


def read_tables(
    paths: Sequence[str | os.PathLike], targets: Sequence[str], features: Sequence[str] | None = None
) -> list[Table]:
    """Read CSV files whose feature columns are matched by name (see module docs): each as :func:`read_table` with the
    first file's features (or ``features``), in that order. Without ``features``, a file whose other columns are not
    exactly the first file's (a missing, extra or renamed column) is refused naming both files and the columns.

    Example:
        >>> from pathlib import Path
        >>> from posthoc_apps.loading.tabular import read_tables
        >>> _ = Path("train.csv").write_text("a,b,y\\n1,2,3\\n4,5,6\\n")
        >>> _ = Path("test.csv").write_text("b,a,y\\n8,7,9\\n")
        >>> [t.features for t in read_tables(["train.csv", "test.csv"], ["y"])]   # test.csv has the columns b, a, y
        [['a', 'b'], ['a', 'b']]
    """
    first = read_table(paths[0], targets, features)
    tables = [first]
    for path in paths[1:]:
        if features is None:
            _check_same_columns(Path(path), first, targets)
        tables.append(read_table(path, targets, first.features))
    return tables


def _check_same_columns(path: Path, first: Table, targets: Sequence[str]) -> None:
    """Refuse ``path`` if its non-target columns are not ``first``'s, naming the differences."""
    if not path.is_file():
        return  # read_table names the missing file
    with path.open(newline="") as handle:
        header = [name.strip() for name in next(csv.reader(handle), [])]
    columns = [name for name in header if name not in targets]
    missing = [name for name in first.features if name not in columns]
    extra = [name for name in columns if name not in first.features]
    if missing or extra:
        parts = ([f"lacks {missing}"] if missing else []) + (
            [f"has {extra}, which {first.path} has not"] if extra else []
        )
        raise InputError(
            f"{path} {' and '.join(parts)}: the files of one run must have the same feature columns as "
            f"{first.path} ({', '.join(first.features)}), matched by name in any order. Rename or drop "
            "columns, or name the model's features with --features"
        )


def _is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (a zip holding ``constants.pkl``, which ``torch.save`` never writes)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") for name in archive.namelist())


def load_module(path: str | os.PathLike) -> nn.Module:
    """The model saved at ``path``: a TorchScript archive (``torch.jit.save``) or a whole pickled ``nn.Module``
    (``torch.save(model, path)``; unpickling runs code, so load only files you trust), in eval mode."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no model file at {path}; save the trained module with torch.save(model, path)")
    if _is_torchscript(path):
        with warnings.catch_warnings():  # torch 2.10+ announces TorchScript's deprecation on every load
            warnings.simplefilter("ignore", FutureWarning)
            loaded = torch.jit.load(str(path), map_location="cpu")
    else:
        loaded = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(loaded, nn.Module):
        what = "a state_dict" if isinstance(loaded, dict) else f"a {type(loaded).__name__}"
        raise InputError(
            f"{path} holds {what}, not a model; save the module itself: torch.save(model, path) (or "
            "torch.jit.save(torch.jit.script(model), path))"
        )
    return loaded.eval()
