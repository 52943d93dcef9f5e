"""Where Dagster's instance storage and MLflow's backend store live.

By default both are embedded sqlite under the state folder (one machine). With
TRAINWISE_POSTGRES_URL set (postgresql+psycopg2://USER@HOST:PORT/DB, password in PGPASSWORD) the Dagster
instance keeps runs, event logs and schedules in DB, and MLflow keeps its runs in DB_mlflow (two
databases, because both keep an `alembic_version` table). The instance's dagster.yaml refers to
the variable (`{env: TRAINWISE_POSTGRES_URL}`), so no URL or secret is written into the file.

`deploy/dagster.yaml` (the multi-machine example with a run launcher) carries the same `storage`
section as `instance_config()`; a test checks both and runs a job against a real PostgreSQL.
No dagster import here (only assets/, sensors/, pipelines/ import it): Dagster reads the YAML.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from trainwise import settings

LOG = logging.getLogger("trainwise.deployment")
POSTGRES_SETTING = "TRAINWISE_POSTGRES_URL"
# First line of a dagster.yaml trainwise writes; a file without it is the user's and kept.
MANAGED_HEADER = "# Written by trainwise (trainwise.deployment); edits are replaced on start."
# What older trainwise versions wrote (no header): still ours to replace.
_LEGACY_CONTENT = "telemetry:\n  enabled: false\n"


# Dagster's queue, drained by the daemon every second instead of its default 5: a launch from
# the Launchpad or a sensor waited 2.5 s on average for nothing (benchmarks/ui_launch.py); a
# query of the run storage a second costs the daemon nothing it notices.
RUN_QUEUE: dict[str, Any] = {"module": "dagster", "class": "QueuedRunCoordinator",
                             "config": {"dequeue_interval_seconds": 1}}


def storage_config() -> dict[str, Any]:
    """Dagster's `storage:` section for PostgreSQL: the URL comes from the environment at load."""
    return {"postgres": {"postgres_url": {"env": POSTGRES_SETTING}}}


def instance_config(postgres: bool | None = None) -> dict[str, Any]:
    """The instance's dagster.yaml as a dict: no usage telemetry (the machine may have no
    network), plus PostgreSQL storage when `postgres` (default: TRAINWISE_POSTGRES_URL is set).
    Without storage Dagster keeps its sqlite files under DAGSTER_HOME."""
    if postgres is None:
        postgres = bool(settings.postgres_url())  # checked: a bad URL is a SettingError here
    config: dict[str, Any] = {"telemetry": {"enabled": False}, "run_coordinator": RUN_QUEUE}
    if postgres:
        config["storage"] = storage_config()
    return config


def instance_yaml(postgres: bool | None = None) -> str:
    return f"{MANAGED_HEADER}\n" + yaml.safe_dump(instance_config(postgres), sort_keys=False)


def write_instance_yaml(dagster_home: Path, postgres: bool | None = None) -> bool:
    """Write `<dagster_home>/dagster.yaml` for the current settings; True when written.

    A dagster.yaml a person wrote (no trainwise header) is left alone, with a warning when it
    lacks the PostgreSQL storage the setting asks for."""
    path = Path(dagster_home) / "dagster.yaml"
    wanted = instance_yaml(postgres)
    if path.exists():
        current = path.read_text()
        if current == wanted:
            return False
        if not current.startswith(MANAGED_HEADER) and current != _LEGACY_CONTENT:
            if "storage" in wanted and "postgres" not in current:
                LOG.warning("%s is not written by trainwise and has no postgres storage, so "
                            "%s is not used by Dagster; add the `storage:` section of "
                            "deploy/dagster.yaml to it", path, POSTGRES_SETTING)
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(wanted)
    return True


def database_names(url: str) -> tuple[str, str]:
    """(Dagster's database, MLflow's database) of a checked TRAINWISE_POSTGRES_URL."""
    dagster_db = urlsplit(url).path.lstrip("/")
    return dagster_db, dagster_db + settings.MLFLOW_DB_SUFFIX


def libpq_url(url: str) -> str:
    """The URL as libpq (psycopg2.connect, psql) reads it: without SQLAlchemy's driver name."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=parts.scheme.split("+", 1)[0]))


def ensure_databases(url: str | None = None, timeout_s: int = 10) -> list[str]:
    """Create Dagster's and MLflow's databases on the server when missing; returns those
    created. Needs the CREATEDB privilege (else ask the database owner for both databases);
    the password comes from PGPASSWORD or ~/.pgpass, as for every libpq client."""
    import psycopg2
    from psycopg2 import sql

    url = url or settings.postgres_url()
    if not url:
        raise settings.SettingError(f"{POSTGRES_SETTING} is empty: there is no PostgreSQL to "
                                    f"prepare; set it to {settings.POSTGRES_SCHEME}://USER@HOST:PORT/DB")
    maintenance = libpq_url(urlunsplit(urlsplit(url)._replace(path="/postgres")))
    created = []
    connection = psycopg2.connect(maintenance, connect_timeout=timeout_s)
    try:
        connection.autocommit = True  # CREATE DATABASE cannot run inside a transaction
        with connection.cursor() as cursor:
            for name in database_names(url):
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cursor.fetchone() is None:
                    cursor.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                    created.append(name)
    finally:
        connection.close()
    return created


def check_postgres(url: str | None = None, timeout_s: int = 5) -> None:
    """Before slow work: both databases answer with these credentials. Otherwise a
    ServiceUnreachableError naming TRAINWISE_POSTGRES_URL and the fix (never the password)."""
    import psycopg2

    from trainwise.services import ServiceUnreachableError

    url = url or settings.postgres_url()
    if not url:
        return  # embedded sqlite: nothing to reach
    for name in database_names(url):
        where = urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
        try:
            psycopg2.connect(libpq_url(where), connect_timeout=timeout_s).close()
        except psycopg2.OperationalError as error:
            text = str(error).strip().replace(os.environ.get("PGPASSWORD") or "\0", "***")
            if "does not exist" in text and "database" in text:
                fix = ("create it: python -c 'from trainwise import deployment; "
                       "deployment.ensure_databases()' (needs CREATEDB), or ask its owner")
            elif "password" in text or "authentication" in text:
                fix = "export the right password in PGPASSWORD (or ~/.pgpass)"
            else:
                fix = "start the server, or fix the host and port"
            raise ServiceUnreachableError(
                f"PostgreSQL database {name!r} of {POSTGRES_SETTING}={url} cannot be used "
                f"({' '.join(text.split()) or type(error).__name__}): {fix}") from error
