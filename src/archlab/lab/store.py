"""The results table of a sweep: one SQLite file (results.sqlite in the sweep folder), one row per run.

SQLite because it is one file, needs no server, survives a crash mid-sweep (every row is committed as
soon as it is written) and can be opened by any tool (`sqlite3 results.sqlite 'select * from runs'`).
A row is keyed by (suite, variant, seed); `status` is one of

    running   started, not finished (a crash or Ctrl-C leaves it so; the next sweep re-runs it)
    done      trained to its budget
    diverged  the loss went NaN/inf (a result, not an error: it is kept and not re-run)
    failed    raised an exception (recorded with the message; re-run by the next sweep)
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archlab.errors import UserError

DB_FILE = "results.sqlite"
STATUSES = ("running", "done", "diverged", "failed")
FINISHED = ("done", "diverged")

_COLUMNS = {
    "suite": "TEXT NOT NULL",
    "variant": "TEXT NOT NULL",
    "seed": "INTEGER NOT NULL",
    "status": "TEXT NOT NULL",
    "config": "TEXT",               # JSON: {"model": ModelConfig.to_dict(), "train": {...}, "overrides": {...}}
    "params": "INTEGER",
    "flops_per_token": "REAL",
    "tokens_seen": "INTEGER",
    "steps": "INTEGER",
    "final_val_loss": "REAL",
    "best_val_loss": "REAL",
    "final_train_loss": "REAL",
    "tokens_per_s": "REAL",
    "step_time_s": "REAL",
    "peak_memory_bytes": "INTEGER",
    "diverged": "INTEGER",
    "extra": "TEXT",                # JSON: suite-specific measurements (val_loss_2x, max_attn_logit, ...)
    "error": "TEXT",
    "run_dir": "TEXT",
    "wall_s": "REAL",
    "started_at": "REAL",
    "finished_at": "REAL",
}


@dataclass
class RunRecord:
    """One row of the results table; `extra` holds measurements beyond the fixed columns."""

    suite: str
    variant: str
    seed: int
    status: str
    config: dict = field(default_factory=dict)
    params: int | None = None
    flops_per_token: float | None = None
    tokens_seen: int | None = None
    steps: int | None = None
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    final_train_loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_memory_bytes: int | None = None
    diverged: bool = False
    extra: dict = field(default_factory=dict)
    error: str | None = None
    run_dir: str | None = None
    wall_s: float | None = None
    started_at: float | None = None
    finished_at: float | None = None

    def metric(self, name: str) -> float | None:
        """A column or an `extra` entry by name (None when absent)."""
        if name in _COLUMNS and name not in ("extra", "config"):
            value = getattr(self, name)
        else:
            value = self.extra.get(name)
        return None if value is None else float(value)


class StoreError(UserError):
    """A results table that cannot be opened (missing, corrupt, not archlab's)."""


class ResultStore:
    """Open (creating if needed) the results table of a sweep folder or a .sqlite path."""

    def __init__(self, path: str | Path, *, readonly: bool = False):
        """readonly: open an existing table without writing a byte to it (reports)."""
        path = Path(path)
        if path.suffix != ".sqlite":
            if not readonly:
                path.mkdir(parents=True, exist_ok=True)
            path = path / DB_FILE
        self.path = path
        if readonly and not path.is_file():
            raise StoreError(f"no results table at {path}")
        try:
            if readonly:
                self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
            else:
                self._db = sqlite3.connect(str(path), timeout=30)
                cols = ", ".join(f"{k} {v}" for k, v in _COLUMNS.items())
                with self._db:
                    self._db.execute(f"CREATE TABLE IF NOT EXISTS runs ({cols}, PRIMARY KEY (suite, variant, seed))")
                    self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            self._db.execute("SELECT count(*) FROM runs").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path} is not a readable archlab results table: {exc}") from exc

    # ---- rows ---------------------------------------------------------------------------------
    def put(self, record: RunRecord) -> None:
        if record.status not in STATUSES:
            raise ValueError(f"status {record.status!r} is not one of {STATUSES}")
        row = {k: getattr(record, k) for k in _COLUMNS}
        row["config"] = json.dumps(record.config, sort_keys=True, default=str)
        row["extra"] = json.dumps(record.extra, sort_keys=True, default=str)
        row["diverged"] = int(bool(record.diverged))
        keys = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._db:
            self._db.execute(f"INSERT OR REPLACE INTO runs ({keys}) VALUES ({marks})", list(row.values()))

    def get(self, suite: str, variant: str, seed: int) -> RunRecord | None:
        cur = self._db.execute("SELECT * FROM runs WHERE suite=? AND variant=? AND seed=?",
                               (suite, variant, seed))
        row = cur.fetchone()
        return None if row is None else self._record(cur.description, row)

    def runs(self, suite: str | None = None, status: str | None = None) -> list[RunRecord]:
        query, args = "SELECT * FROM runs", []
        conds = []
        if suite is not None:
            conds.append("suite=?")
            args.append(suite)
        if status is not None:
            conds.append("status=?")
            args.append(status)
        if conds:
            query += " WHERE " + " AND ".join(conds)
        cur = self._db.execute(query + " ORDER BY suite, started_at, variant, seed", args)
        return [self._record(cur.description, row) for row in cur.fetchall()]

    def suites(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT DISTINCT suite FROM runs ORDER BY suite")]

    @staticmethod
    def _record(description, row) -> RunRecord:
        data = {d[0]: v for d, v in zip(description, row)}
        data["config"] = json.loads(data["config"] or "{}")
        data["extra"] = json.loads(data["extra"] or "{}")
        data["diverged"] = bool(data["diverged"])
        return RunRecord(**data)

    # ---- sweep metadata (the suite as run, budget, data) ----------------------------------------
    def set_meta(self, key: str, value: Any) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             (key, json.dumps(value, default=str)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def now() -> float:
    return time.time()
