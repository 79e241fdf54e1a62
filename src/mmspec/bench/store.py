"""Append-only JSONL result files that survive being killed mid-write.

Owns the on-disk format of a results directory:

- ``results.rank{R}.jsonl``: one JSON object a line, written by rank R only. Every append is
  flushed and fsync'ed, so a finished row is on disk before the next one starts. A process
  killed mid-write can leave one torn last line (no trailing newline, or invalid JSON): on
  open it is detected, reported and truncated away, so re-running resumes cleanly. The file is
  created by the first row, so a run that fails before finishing one leaves no empty file.
- ``run.rank{R}.json``: metadata of the runs that wrote that rank file (command, machine,
  config, fingerprint).

Rows are identified by :func:`row_key`; a row whose key is already on disk is never rerun.
The same append-only, resumable format serves other per-sample outputs with their own key
(``RowWriter(path, key=...)``: the target answers of :mod:`mmspec.train.distill`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path

from mmspec.errors import MMSpecError

RowKey = tuple[str, str, str, str]  # (kind, dataset, uid, method)


def row_key(row: dict) -> RowKey:
    """Identity of a row: kind ('baseline' | 'spec' | 'latency'), dataset, sample uid, method."""
    return (row["kind"], row["dataset"], str(row.get("uid", "")), row.get("method", ""))


def results_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"results.rank{rank}.jsonl"


def _scan(data: bytes, path: Path) -> tuple[list[dict], int, list[str]]:
    """Parse complete lines; return (rows, byte length of the good prefix, warnings)."""
    rows: list[dict] = []
    warnings: list[str] = []
    pos = 0
    good_end = 0
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        is_last = i == len(lines) - 1
        end = pos + len(line) + (0 if is_last else 1)
        if is_last:  # bytes after the final newline: empty, or a torn line
            if line.strip():
                warnings.append(f"{path}: dropped a torn last line ({len(line)} bytes, no newline)")
            break
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 2:  # the last complete line is garbage: torn, drop it
                    warnings.append(f"{path}: dropped an unreadable last line ({len(line)} bytes)")
                    break
                raise MMSpecError(
                    f"{path}: line {i + 1} is not valid JSON and is not the last line, so this "
                    "is not a torn write; inspect or delete the file, or use a new --out dir"
                ) from None
        good_end = end
        pos = end
    return rows, good_end, warnings


def read_rows(path: Path) -> tuple[list[dict], list[str]]:
    """Read a results file without modifying it (a torn tail is skipped, with a warning)."""
    path = Path(path)
    if not path.exists():
        return [], []
    rows, _, warnings = _scan(path.read_bytes(), path)
    return rows, warnings


class RowWriter:
    """One rank's results file, opened for resuming: knows the finished keys, appends durably.
    ``key`` identifies a row (default :func:`row_key`)."""

    def __init__(self, path: Path, key: Callable[[dict], Hashable] = row_key) -> None:
        self.path = Path(path)
        self.key = key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.warnings: list[str] = []
        self.rows: list[dict] = []
        if self.path.exists():
            data = self.path.read_bytes()
            self.rows, good_end, self.warnings = _scan(data, self.path)
            if good_end < len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(good_end)
                    f.flush()
                    os.fsync(f.fileno())
        self.done: set[Hashable] = {self.key(r) for r in self.rows}
        self._f = None  # opened by the first row written

    def __contains__(self, key: Hashable) -> bool:
        return key in self.done

    def append(self, row: dict) -> None:
        """Write one row as one line, then flush and fsync before returning."""
        self.extend([row])

    def extend(self, rows: Iterable[dict]) -> None:
        """Write rows not on disk yet, one line each, then flush and fsync once."""
        for row in rows:
            key = self.key(row)
            if key in self.done:
                continue
            if self._f is None:
                self._f = open(self.path, "a", encoding="utf-8")
            self._f.write(json.dumps(row, separators=(",", ":")) + "\n")
            self.done.add(key)
            self.rows.append(row)
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rank_files(results_dir: Path) -> list[Path]:
    files = sorted(Path(results_dir).glob("results.rank*.jsonl"))
    return files or sorted(Path(results_dir).glob("results*.jsonl"))


def merge_rows(results_dir: Path) -> tuple[list[dict], list[str]]:
    """All rows of all rank files in a directory, duplicates (same key) dropped, first wins."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise MMSpecError(f"{results_dir} is not a directory; pass the --out dir of a bench run")
    files = rank_files(results_dir)
    if not files:
        raise MMSpecError(
            f"no results.rank*.jsonl in {results_dir}; run `mmspec bench run --out {results_dir}`"
        )
    seen: set[RowKey] = set()
    merged: list[dict] = []
    warnings: list[str] = []
    for f in files:
        rows, w = read_rows(f)
        warnings += w
        for r in rows:
            k = row_key(r)
            if k not in seen:
                seen.add(k)
                merged.append(r)
    if not merged:
        raise MMSpecError(
            f"{results_dir} holds no results: {', '.join(f.name for f in files)} "
            f"{'has' if len(files) == 1 else 'have'} no finished rows (a run that stopped before its first "
            f"sample); run `mmspec bench run --out {results_dir}` (it resumes there) and report again"
        )
    return merged, warnings


def read_run_meta(results_dir: Path) -> list[dict]:
    metas: list[dict] = []
    for f in sorted(Path(results_dir).glob("run.rank*.json")):
        metas.extend(json.loads(f.read_text()).get("runs", []))
    return metas


def append_run_meta(results_dir: Path, rank: int, meta: dict) -> None:
    """Record one invocation in ``run.rank{R}.json`` (a list: resumed runs add entries)."""
    path = Path(results_dir) / f"run.rank{rank}.json"
    runs = json.loads(path.read_text()).get("runs", []) if path.exists() else []
    runs.append(meta)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": runs}, indent=1, default=str))
    os.replace(tmp, path)


def iter_kind(rows: Iterable[dict], kind: str) -> Iterator[dict]:
    return (r for r in rows if r.get("kind") == kind)
