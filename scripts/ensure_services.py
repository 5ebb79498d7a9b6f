"""Make sure the services the tests talk to answer: Redis (started privately if none
does) and PostgreSQL on 127.0.0.1:5432 (the Debian cluster started, or a private
trust-auth cluster made with initdb, if nothing answers)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from conveyor.redis_server import redis_answers, start_private_redis

TEST_REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_HOST, POSTGRES_PORT = "127.0.0.1", 5432
PRIVATE_POSTGRES_DIR = Path(".conveyor/test/postgres")


def main() -> int:
    ensure_redis()
    ensure_postgres()
    return 0


def ensure_redis() -> None:
    if redis_answers(TEST_REDIS_URL):
        print(f"redis: answering at {TEST_REDIS_URL}")
        return
    process = start_private_redis(TEST_REDIS_URL, Path(".conveyor/test"))
    print(f"redis: started a private redis-server (pid {process.pid}) at {TEST_REDIS_URL}")


def postgres_answers(timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((POSTGRES_HOST, POSTGRES_PORT), timeout=timeout_s):
            return True
    except OSError:
        return False


def ensure_postgres() -> None:
    """Best effort: the SQL tests skip without PostgreSQL locally and fail under CI."""
    where = f"{POSTGRES_HOST}:{POSTGRES_PORT}"
    if postgres_answers():
        print(f"postgres: answering at {where}")
        return
    how = _start_debian_cluster() or _start_private_cluster()
    if how is None:
        print(
            f"postgres: nothing answers at {where} and none could be started "
            "(install Debian's postgresql package); the SQL tests need one",
            file=sys.stderr,
        )
        return
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not postgres_answers(0.5):
        time.sleep(0.2)
    state = "answering" if postgres_answers() else "NOT answering"
    print(f"postgres: started {how}; {state} at {where}")


def _start_debian_cluster() -> str | None:
    """Debian's packaged cluster (`pg_ctlcluster VERSION main start`), when there is one."""
    if shutil.which("pg_ctlcluster") is None or not Path("/etc/postgresql").is_dir():
        return None
    for version in sorted(os.listdir("/etc/postgresql"), reverse=True):
        if not Path(f"/etc/postgresql/{version}/main").is_dir():
            continue
        command = ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"]
        if subprocess.run(command, check=False).returncode == 0:
            return f"the Debian cluster {version}/main"
    return None


def _start_private_cluster() -> str | None:
    """A trust-auth cluster in .conveyor/test/postgres (run as the postgres user when root,
    since initdb refuses to run as root)."""
    initdb, pg_ctl = _postgres_binary("initdb"), _postgres_binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        return None
    folder = PRIVATE_POSTGRES_DIR.resolve()
    as_user: list[str] = []
    if os.geteuid() == 0:
        if (
            shutil.which("runuser") is None
            or subprocess.run(["id", "postgres"], capture_output=True, check=False).returncode
        ):
            return None
        as_user = ["runuser", "-u", "postgres", "--"]
    if not (folder / "PG_VERSION").exists():
        folder.mkdir(parents=True, exist_ok=True)
        if as_user:
            shutil.chown(folder, "postgres")
        init = [*as_user, initdb, "-D", str(folder), "-U", "postgres", "--auth=trust"]
        if subprocess.run(init, capture_output=True, check=False).returncode:
            return None
    options = f"-c listen_addresses={POSTGRES_HOST} -p {POSTGRES_PORT} -k {folder}"
    start = [
        *as_user,
        pg_ctl,
        "-D",
        str(folder),
        "-l",
        str(folder / "server.log"),
        "-o",
        options,
        "start",
    ]
    if subprocess.run(start, capture_output=True, check=False).returncode:
        return None
    return f"a private cluster in {folder}"


def _postgres_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)
    return str(candidates[0]) if candidates else None


if __name__ == "__main__":
    sys.exit(main())
