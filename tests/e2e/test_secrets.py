"""Secrets and trust boundaries on a shared box (issue 26, items 2 and 5), as a user runs
``slotctl up``: the one-time dashboard link only on a terminal (never in a log file or
the journal), a private state dir, and the warning of a root controller on the process
runtime. ``POST /api/login``'s JSON-only rule is in ``tests/e2e/test_cli_ux.py``
(``test_login_codes_are_one_time_and_slotctl_dashboard_prints_a_new_one``).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.test_api import Api


class Terminal:
    """A pseudo-terminal a child writes to; its output collected by a thread."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self.chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        os.close(self.slave)  # the child holds it now
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the child side is closed
                return
            if not data:
                return
            self.chunks.append(data)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace").replace("\r\n", "\n")

    def close(self) -> None:
        self._reader.join(10)
        os.close(self.master)


def test_up_prints_a_login_link_only_on_a_terminal(ctl: Slotctl) -> None:
    """Before: ``slotctl up`` printed the link wherever its output went (a 0644 log
    file, the journal): for 15 minutes anyone who read it could buy the API token with
    it. Its output to a file now says where to get one; on a terminal it is printed."""
    ctl.start_up()
    log = ctl.wait_log("dashboard login: ")
    assert "#login=" not in log
    assert "`slotctl dashboard` prints a one-time link" in log
    ctl.ok("down")

    terminal = Terminal()
    proc = subprocess.Popen(
        ctl.argv("up", "--listen", "127.0.0.1:0"),
        stdin=subprocess.DEVNULL,
        stdout=terminal.slave,
        stderr=terminal.slave,
        env=ctl.env,
        cwd=ctl.tmp,
    )
    terminal.start()
    try:
        wait_until(lambda: "#login=" in terminal.text, "the login link on the terminal", 60)
        line = next(x for x in terminal.text.splitlines() if "dashboard login: " in x)
        link = line.split("dashboard login: ", 1)[1].split()[0]
        record = json.loads((ctl.state / "controller.json").read_text())
        host, _, port = record["listen"].rpartition(":")
        token = (ctl.state / "token").read_text().strip()
        assert link.startswith(f"http://{record['listen']}/#login=")
        reply = Api(host, int(port), token).call(
            "POST", "/api/login", {"code": link.split("#login=", 1)[1]}, token=None
        )
        assert reply.status == 200 and reply.body == {"token": token}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        terminal.close()


def test_the_state_dir_is_private(ctl: Slotctl) -> None:
    """The state dir (the token, the servers' logs, the state files) is 0700, as etcd's
    data dir: created so, and an existing one open to others is tightened, said once."""
    ctl.state.mkdir(mode=0o755)
    os.chmod(ctl.state, 0o755)
    ctl.start_up()
    log = ctl.wait_log("was open to other users: made it private (0700")
    assert stat.S_IMODE(ctl.state.stat().st_mode) == 0o700
    # The token is written when the API starts, after that line: wait for it (a loaded
    # machine showed the gap).
    wait_until(lambda: (ctl.state / "token").exists(), "the API token")
    assert stat.S_IMODE((ctl.state / "token").stat().st_mode) == 0o600
    ctl.ok("down")
    ctl.start_up()
    ctl.wait_log("dashboard login: ")
    assert "made it private" not in ctl.controller_log()
    assert "made it private" in log


def test_up_warns_when_it_runs_as_root_on_the_process_runtime(ctl: Slotctl) -> None:
    """Every server of the process runtime runs as the controller's user, and a stack
    file chooses its binary, arguments and environment: as root, that is root for
    whoever may write a stack file. ``up`` says so at start (``docker`` and
    ``kubernetes`` run their servers in containers)."""
    ctl.start_up()
    log = ctl.wait_log("dashboard login: ")
    warned = "runs as root with the process runtime" in log
    assert warned == (os.geteuid() == 0), log
    started = time.monotonic()
    ctl.ok("down")
    assert time.monotonic() - started < 60
