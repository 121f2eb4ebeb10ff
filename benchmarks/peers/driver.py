"""A column's process that answers JSON lines: the first line it prints says it is ready, then
one reply line for each request line on its stdin (vllm_offline.py, epd.py)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path

from benchmarks.peers import LOG_DIR, PeerUnavailable, log_tail, start_process, stop_group


class LineDriver:
    def __init__(self, name: str, argv: list[str], log_name: str, start_timeout_s: float,
                 env: dict[str, str] | None = None) -> None:
        """Starts ``argv`` (its own process group, stderr to .peers/logs/``log_name``) and waits for
        its ready line (:attr:`hello`); raises PeerUnavailable when it does not come up."""
        self.name = name
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path: Path = LOG_DIR / log_name
        with open(self.log_path, "w") as log:
            self.process = start_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        self._unread = b""
        self._busy = True
        """Loading or running a batch, so not reading its stdin: close() does not wait for it."""
        try:
            self.hello: dict = self._reply(start_timeout_s)
        except BaseException:  # not up, or Ctrl-C / SIGTERM while it loads
            self.close()
            raise
        self._busy = False

    def ask(self, request: dict, timeout_s: float) -> dict:
        self._busy = True
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        reply = self._reply(timeout_s)
        self._busy = False
        return reply

    def close(self) -> None:
        """Asks the driver to exit (end of its stdin), then stops its whole group: at once when it is
        busy (Ctrl-C or SIGTERM in the middle of a batch), else after a grace period."""
        if not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except BrokenPipeError:  # it already exited with bytes unread
                pass
        stop_group(self.process, 0 if self._busy else 30)
        self.process.stdout.close()

    def _reply(self, timeout_s: float) -> dict:
        """The driver's next line. Raw reads (not readline) so select never waits on bytes that a
        buffered reader already holds."""
        deadline = time.monotonic() + timeout_s
        fd = self.process.stdout.fileno()
        while b"\n" not in self._unread:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise PeerUnavailable(f"{self.name} gave no answer within {timeout_s:.0f} s (log {self.log_path})")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise PeerUnavailable(f"{self.name} exited with {self.process.wait()}: {log_tail(self.log_path, 5)}")
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return json.loads(line)
