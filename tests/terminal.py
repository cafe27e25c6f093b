"""Run a command on a pseudo-terminal, as a user's shell would: what a progress bar draws only when it sees a tty."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import termios
import time


def in_a_terminal(cmd: list[str], env: dict, cwd: str, columns: int | None = None,
                  timeout: float = 150) -> tuple[str, int]:
    """Run `cmd` with its stdout and stderr on a pty; `columns`=None leaves the width unset, as a bare pty (an
    IDE's, `docker exec -t`'s) often does. Returns (raw output, exit code)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(cwd)
        os.execve(cmd[0], cmd, env)
    if columns:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    out, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status)
