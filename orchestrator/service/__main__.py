"""`python -m orchestrator.service stop|status`: end this user's service (its Ray with it), or
show it. `serve` is how a command starts it (orchestrator/service/client.py)."""

from __future__ import annotations

import json
import sys

USAGE = "usage: python -m orchestrator.service stop|status"


def ask(message: dict) -> dict | None:
    """The service's answer; None where none listens. NotPrivateError, ForeignListener: the
    folder or the socket is not this user's (nothing was sent)."""
    from orchestrator.service.place import Reader, connect, send, socket_path

    conn = connect(socket_path())
    if conn is None:
        return None
    with conn:
        send(conn, message)
        return Reader(conn).next()


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        from orchestrator.service.server import main as serve

        serve()
        return 0
    if argv not in (["stop"], ["status"]):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        reply = ask({argv[0]: True})
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if reply is None:
        print("no service is running")
        return 0 if argv == ["stop"] else 1
    if argv == ["stop"]:
        if not wait_stopped(int(reply["stopping"])):
            print(f"service {reply['stopping']} stops once the command it runs ends")
            return 1
        print(f"service {reply['stopping']} stopped")
    else:
        print(json.dumps(reply))
    return 0


def wait_stopped(pid: int, timeout_s: float = 60.0) -> bool:
    """Until the service's process (which shuts its Ray down first) has ended: gone, or a
    zombie (ended, and not yet waited for by whichever process it was re-parented to). False
    if it still runs after ``timeout_s`` (a command it serves)."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
