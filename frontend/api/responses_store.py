"""Stored responses (`store`, `previous_response_id`, GET / DELETE /v1/responses/{id}).

One SQLite file (`--responses-store PATH`), shared by every frontend and replica of the host
and kept across restarts: WAL mode, so readers never wait on the writer, and a busy timeout, so
processes take turns writing. Every call runs on the store's own thread, never on the event
loop. A row is found only by its id together with its tenant: another tenant's id reads as
missing (404). Retention: rows older than `--responses-store-days` go, and past
`--responses-store-bytes` the oldest go first; both are applied as a response is stored.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gapless.common.config import EngineConfig
from gapless.common.model_cache import cache_dir

BUSY_TIMEOUT_MS = 10_000  # another process's write waited for at most this
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    size INTEGER NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


class Stored:
    """A response as kept: its body and the items it continued from (its context)."""

    __slots__ = ("response", "context")

    def __init__(self, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        self.response = response
        self.context = context


class ResponseStore:
    def __init__(self, path: str, max_age_days: float, max_bytes: int) -> None:
        self.path = path
        self.max_age_s = max_age_days * 86_400
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="responses-store")
        self._db: sqlite3.Connection | None = None  # opened on the store's thread, at first use

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            db.executescript(SCHEMA)
            self._db = db
        return self._db

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def put(self, tenant: str, response: dict[str, Any], context: list[Any]) -> None:
        await self._run(self._put, tenant, response, context)

    async def get(self, response_id: str, tenant: str) -> Stored | None:
        return await self._run(self._get, response_id, tenant)

    async def delete(self, response_id: str, tenant: str) -> bool:
        return await self._run(self._delete, response_id, tenant)

    def close(self) -> None:
        self._pool.submit(self._close).result()
        self._pool.shutdown()

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _put(self, tenant: str, response: dict[str, Any], context: list[Any]) -> None:
        body, items = json.dumps(response), json.dumps(context)
        size = len(body) + len(items)
        db = self._conn()
        with db:
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (response["id"], tenant, response["created_at"], size, body, items),
            )
            self._prune(db)

    def _prune(self, db: sqlite3.Connection) -> None:
        """Rows past the age limit, then the oldest while the total passes the byte limit."""
        db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
        (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()
        if total <= self.max_bytes:
            return
        over, doomed = total - self.max_bytes, []
        for rid, size in db.execute("SELECT id, size FROM responses ORDER BY created_at"):
            doomed.append((rid,))
            over -= size
            if over <= 0:
                break
        db.executemany("DELETE FROM responses WHERE id = ?", doomed)

    def _get(self, response_id: str, tenant: str) -> Stored | None:
        row = (
            self._conn()
            .execute(
                "SELECT response, context FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant),
            )
            .fetchone()
        )
        return None if row is None else Stored(json.loads(row[0]), json.loads(row[1]))

    def _delete(self, response_id: str, tenant: str) -> bool:
        db = self._conn()
        with db:
            cur = db.execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)
            )
        return cur.rowcount > 0


def open_store(config: EngineConfig) -> ResponseStore | None:
    """The store `--responses-store` names (responses.sqlite in the model cache when left
    out); none keeps nothing. The file is opened at first use."""
    spec = config.responses_store
    if spec == "none":
        return None
    path = spec or str(cache_dir() / "responses.sqlite")
    return ResponseStore(path, config.responses_store_days, config.responses_store_bytes)
