"""Rows of a real benchmark read from local files: which files hold the asked split, and
reading them lazily, a cheap column before the image bytes.

Owns the file side of the real benchmarks. A data set path is one of:

- a parquet file: read as given (the file is the choice; no split applies);
- a directory of parquet files, e.g. a hub snapshot: only the files of the asked split are
  read. A file's split is the part of its name before ``-NNNNN-of-NNNNN``
  (``data/validation-00000-of-00003.parquet``), else its name (``test.parquet``), or for the
  hub's parquet-converter layout (``default/image/0000.parquet``) its folder's name;
- a ``datasets.save_to_disk`` directory: the asked split of a ``DatasetDict``, or the
  ``Dataset`` itself.

:meth:`RowSource.rows` reads parquet one row group at a time; given a ``where`` column and a
``keep`` test, it reads that column of a row group first and the rest of the group (the image
bytes) only where some row passes, so a few hundred rows of one sub-task come out of the 3 GB
interleave bench without reading the rest. It knows nothing about prompts or images.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmspec.bench.optional import require
from mmspec.errors import MMSpecError

_SHARD = re.compile(r"^(?P<split>.+?)-\d+-of-\d+")
_BATCH_ROWS = 64  # rows converted to Python at a time (a row holds up to 12 images' bytes)


def file_split(f: Path) -> str:
    """The split a parquet file of a snapshot belongs to, from its name (see the module doc)."""
    m = _SHARD.match(f.name)
    if m:
        return m["split"]
    return f.parent.name if f.stem.isdigit() else f.stem


def _parquet_files(path: Path) -> list[Path]:
    files = (p for p in path.rglob("*.parquet")
             if not any(part.startswith(".") for part in p.relative_to(path).parts))  # e.g. .cache/
    return sorted(files)


def split_files(path: Path, split: str, name: str) -> list[Path]:
    """The parquet files of ``split`` under directory ``path`` ([] when it holds none at all);
    a directory whose files are all of other splits is refused with the splits it has."""
    files = _parquet_files(path)
    mine = [f for f in files if file_split(f) == split]
    if files and not mine:
        found = sorted({file_split(f) for f in files})
        raise MMSpecError(
            f"{path} has no parquet files of split {split!r} for {name} (files named {split}-*.parquet, "
            f"{split}.parquet or {split}/*.parquet); its splits: {', '.join(found)}. Pick one with "
            f"--dataset {name}={path}:SPLIT (e.g. :{found[0]}), or pass one parquet file"
        )
    return mine


def open_parquet(f: Path):
    """A ``pyarrow.parquet.ParquetFile``, or a clear error for a file that is not parquet."""
    pq = require("pyarrow.parquet", "reading a benchmark's parquet files")

    try:
        return pq.ParquetFile(f)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid (a ValueError): not a parquet file
        raise MMSpecError(f"{f} is not a readable parquet file ({e.__class__.__name__}: {e}); fix or remove "
                          "it, or pass a datasets.save_to_disk directory instead") from None


@dataclass
class RowSource:
    """The rows of one split, not yet read: parquet ``files``, or a ``datasets.Dataset``."""

    label: str  # names the data in messages: the file, or "DIR (split S)"
    columns: list[str]
    base: Path  # where the rows' relative image paths start: the directory given, or the file's
    files: tuple[Path, ...] = ()
    dataset: Any = None  # a datasets.Dataset (save_to_disk input), else None

    def rows(self, where: str | None = None,
             keep: Callable[[Any], bool] | None = None) -> Iterator[tuple[int, dict]]:
        """``(index in the split, row)`` pairs in file order. With ``where`` and ``keep``, only the
        rows whose ``where`` cell passes ``keep``, tested before their other cells are read."""
        if self.dataset is not None:
            yield from self._dataset_rows(where, keep)
            return
        offset = 0
        for f in self.files:
            pf = open_parquet(f)
            for rg in range(pf.num_row_groups):
                n_rows = pf.metadata.row_group(rg).num_rows
                picked = range(n_rows)
                if where is not None and keep is not None:
                    cells = pf.read_row_group(rg, columns=[where]).column(0).to_pylist()
                    picked = [k for k, v in enumerate(cells) if keep(v)]
                if picked:
                    yield from self._group_rows(pf, rg, offset, set(picked))
                offset += n_rows

    @staticmethod
    def _group_rows(pf, rg: int, offset: int, picked: set[int]) -> Iterator[tuple[int, dict]]:
        start = 0
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=[rg]):
            mine = [k for k in range(batch.num_rows) if start + k in picked]
            if mine:
                rows = batch.take(mine).to_pylist() if len(mine) < batch.num_rows else batch.to_pylist()
                yield from ((offset + start + k, row) for k, row in zip(mine, rows))
            start += batch.num_rows

    def _dataset_rows(self, where, keep) -> Iterator[tuple[int, dict]]:
        ds = self.dataset
        if where is not None and keep is not None:
            idx = [i for i, v in enumerate(ds[where]) if keep(v)]  # one column: no image decoded
        else:
            idx = range(len(ds))
        for i in idx:
            yield i, ds[i]


def open_rows(path: Path, split: str, name: str) -> RowSource:
    """The rows of ``split`` of data set ``name`` at ``path`` (see the module doc for the forms)."""
    path = Path(path)
    if not path.exists():
        raise MMSpecError(
            f"dataset path {path} does not exist; pass a parquet file, a directory of parquet "
            "files, or a datasets.save_to_disk directory"
        )
    if path.is_file():
        return RowSource(str(path), open_parquet(path).schema_arrow.names, path.parent, (path,))
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        return _saved_rows(path, split, name)
    files = split_files(path, split, name)
    if not files:
        raise MMSpecError(f"{path} holds no *.parquet files and is not a datasets.save_to_disk directory")
    label = str(files[0]) if len(files) == 1 else f"{path} (split {split})"
    return RowSource(label, open_parquet(files[0]).schema_arrow.names, path, tuple(files))


def _saved_rows(path: Path, split: str, name: str) -> RowSource:
    datasets = require("datasets", "reading a datasets.save_to_disk folder")

    ds = datasets.load_from_disk(str(path))
    label = str(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise MMSpecError(f"{path} has no split {split!r} for {name}; its splits: {', '.join(ds)}. Pick "
                              f"one with --dataset {name}={path}:SPLIT")
        ds, label = ds[split], f"{path} (split {split})"
    return RowSource(label, list(ds.column_names), path, dataset=ds)
