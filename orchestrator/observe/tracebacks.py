"""A program's traceback on the console, shortened where it only says a peer rank is gone.

When one rank of a torchrun script dies (killed, preempted), the others fail in their next
collective with a ~25-line gloo or NCCL traceback that says nothing but "the peer is gone"; the
run's own lines already say which rank died and what happens next. The console gets the
traceback's last line and how many lines were left out; logs/rank_<r>.log keeps every line.
"""

from __future__ import annotations

import re

START = "Traceback (most recent call last):"
# A Python exception's last line (not indented), as the script trainer reads it too.
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)")
# A rank's error that only echoes another rank's death: its collective lost the peer.
COLLECTIVE_ECHOES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                     "pair.cc", "Socket Timeout", "ProcessGroupGloo", "NCCL communicator",
                     "DistBackendError", "remote process exited")


def echoes_a_peer(text: str) -> bool:
    return any(echo in text for echo in COLLECTIVE_ECHOES)

MOST_HELD = 400  # lines of one unfinished traceback held back before they are shown as they are


class ConsoleTracebacks:
    """Feed each batch of a rank's lines; get back the lines to show. A traceback is held
    until its last line comes (or the program ends: ``flush``)."""

    def __init__(self) -> None:
        self._held: list[str] = []

    def feed(self, lines: list[str]) -> list[str]:
        shown = []
        for line in lines:
            if self._held:
                self._held.append(line)
                if ERROR_LINE.match(line):
                    shown += self._close()
                elif len(self._held) > MOST_HELD:
                    shown += self.flush()
            elif line.strip() == START:
                self._held = [line]
            else:
                shown.append(line)
        return shown

    def flush(self) -> list[str]:
        held, self._held = self._held, []
        return held

    def _close(self) -> list[str]:
        block, self._held = self._held, []
        last = block[-1]
        if not echoes_a_peer(last):
            return block
        return [f"{last}  ({len(block) - 1} lines of its traceback, a peer rank gone, are "
                "in this rank's log)"]
