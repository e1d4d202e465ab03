"""Replicas as a user declares them (issue 38): ``replicas = 2`` in a stack file, applied
and run by a real ``slotctl up`` on the process runtime with demo servers: both replicas
come up as slots of their own (``chat``, ``chat-r1``), each with its own server and
port, shown together by ``slot list`` (through the controller and from the files), and
``stack diff`` counts the replica as declared, not as an orphan."""

from __future__ import annotations

from tests.e2e.conftest import Slotctl, SlotDef, stack_text


def test_a_slot_with_two_replicas_runs_two_servers(ctl: Slotctl) -> None:
    path = ctl.tmp / "replicas.toml"
    slot = SlotDef("chat", options=(("replicas", "2"),), extra=("--prefix-cache", "8"))
    path.write_text(stack_text("rep", [slot]))
    ctl.ok("stack", "apply", path)
    local = ctl.json("slot", "list")  # from the files: the replica is declared too
    assert [(r["name"], r["replica_of"], r["replica_index"]) for r in local] == [
        ("chat", "chat", 0),
        ("chat-r1", "chat", 1),
    ]
    got = ctl.json("slot", "get", "chat-r1")  # from the files, as declared by chat
    assert got["spec"]["model"]["default"] == "m-chat" and got["stack"] == "rep"
    ctl.start_up()
    ctl.wait_states({"chat": "ready", "chat-r1": "ready"})
    pids = ctl.pids()
    assert set(pids) == {"chat", "chat-r1"} and pids["chat"] != pids["chat-r1"]
    table = ctl.ok("slot", "list")
    lines = [line for line in table.splitlines() if line.startswith("chat")]
    assert lines[0].startswith("chat ") and "replica 1 of chat" in lines[1], table
    diff = ctl.run("stack", "diff", path)
    assert "orphan" not in diff.stdout, diff.stdout
    ctl.ok("down")
