"""Stored responses (`store`, `previous_response_id`, GET / DELETE /v1/responses/{id}).

By default one SQLite file (`--responses-store PATH`), shared by every frontend and replica of
the host and kept across restarts: WAL mode, so readers never wait on the writer, and a busy
timeout, so processes take turns writing. A `postgresql://` URL keeps them in PostgreSQL
instead (psycopg, the `postgres` extra), for several hosts behind one gateway. Every call runs
on the store's own thread, never on the event loop. A row is found only by its id together with
its tenant: another tenant's id reads as missing (404). Retention: rows older than
`--responses-store-days` go, and past `--responses-store-bytes` the oldest go first; both are
applied as a response is stored.
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
POSTGRES_PREFIXES = ("postgresql://", "postgres://")
# {real}: the floating type's name, {q}: the placeholder
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at {real} NOT NULL,
    size BIGINT NOT NULL,
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
    """The async face of the store; `_open` makes its DB-API connection on its thread."""

    placeholder = "?"

    def __init__(self, target: str, max_age_days: float, max_bytes: int) -> None:
        self.target = target
        self.max_age_s = max_age_days * 86_400
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="responses-store")
        self._db: Any = None  # opened on the store's thread, at first use

    def _open(self) -> Any:
        Path(self.target).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.target, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.executescript(SCHEMA.format(real="REAL"))
        return db

    def _transaction(self, db: Any) -> Any:
        return db  # sqlite3: commits (or rolls back) at the end of `with`

    def _conn(self) -> Any:
        if self._db is None:
            self._db = self._open()
        return self._db

    def _sql(self, text: str) -> str:
        return text.replace("?", self.placeholder)

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
        with self._transaction(db):
            cur = db.cursor()
            cur.execute(
                self._sql(
                    "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE "
                    "SET tenant = excluded.tenant, created_at = excluded.created_at, "
                    "size = excluded.size, response = excluded.response, "
                    "context = excluded.context"
                ),
                (response["id"], tenant, response["created_at"], size, body, items),
            )
            self._prune(cur)

    def _prune(self, cur: Any) -> None:
        """Rows past the age limit, then the oldest while the total passes the byte limit."""
        oldest = time.time() - self.max_age_s
        cur.execute(self._sql("DELETE FROM responses WHERE created_at < ?"), (oldest,))
        cur.execute("SELECT COALESCE(SUM(size), 0) FROM responses")
        (total,) = cur.fetchone()
        if total <= self.max_bytes:
            return
        over, doomed = total - self.max_bytes, []
        cur.execute("SELECT id, size FROM responses ORDER BY created_at")
        for rid, size in cur.fetchall():
            doomed.append((rid,))
            over -= size
            if over <= 0:
                break
        cur.executemany(self._sql("DELETE FROM responses WHERE id = ?"), doomed)

    def _get(self, response_id: str, tenant: str) -> Stored | None:
        db = self._conn()
        with self._transaction(db):
            cur = db.cursor()
            cur.execute(
                self._sql("SELECT response, context FROM responses WHERE id = ? AND tenant = ?"),
                (response_id, tenant),
            )
            row = cur.fetchone()
        return None if row is None else Stored(json.loads(row[0]), json.loads(row[1]))

    def _delete(self, response_id: str, tenant: str) -> bool:
        db = self._conn()
        with self._transaction(db):
            cur = db.cursor()
            cur.execute(
                self._sql("DELETE FROM responses WHERE id = ? AND tenant = ?"),
                (response_id, tenant),
            )
            return cur.rowcount > 0


class PostgresStore(ResponseStore):
    """The same rows in PostgreSQL (psycopg 3, the `postgres` extra)."""

    placeholder = "%s"

    def _open(self) -> Any:
        try:
            import psycopg
        except ImportError:
            raise RuntimeError(
                "--responses-store postgresql://... needs psycopg: pip install 'gapless[postgres]'"
            ) from None
        db = psycopg.connect(self.target, autocommit=True)
        with db.transaction():
            for statement in SCHEMA.format(real="DOUBLE PRECISION").split(";"):
                if statement.strip():
                    db.execute(statement)
        return db

    def _transaction(self, db: Any) -> Any:
        return db.transaction()  # why not `with db`: psycopg closes the connection there


def open_store(config: EngineConfig) -> ResponseStore | None:
    """The store `--responses-store` names (responses.sqlite in the model cache when left
    out); none keeps nothing. It is opened at first use."""
    spec = config.responses_store
    if spec == "none":
        return None
    days, size = config.responses_store_days, config.responses_store_bytes
    if spec is not None and spec.startswith(POSTGRES_PREFIXES):
        return PostgresStore(spec, days, size)
    return ResponseStore(spec or str(cache_dir() / "responses.sqlite"), days, size)
