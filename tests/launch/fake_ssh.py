#!/usr/bin/env python3
"""Stands in for `ssh HOST 'remote command'` in tests: runs the command with `sh -c`, as sshd would.

Like a real ssh session, the remote side lives in its own session (our signals do not reach it) and
its stdin is a relay of ours: when this process dies, the remote command sees EOF on stdin.
The command gets a fresh environment like sshd gives a non-login command on a Mac: PATH is only
/usr/bin:/bin:/usr/sbin:/sbin (no venv, Homebrew or pyenv), and nothing of the caller's environment
(PYTHONPATH, VIRTUAL_ENV, ...) comes along. Each call appends the target host to $FAKE_SSH_LOG, and
when $FAKE_SSH_ARGV_LOG is set, its whole argv (what `ps` shows of the local ssh, the remote command
included) as a JSON line.
"""
import json
import os
import signal
import subprocess
import sys
import threading

REMOTE_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"  # what a Mac's sshd gives a non-login command


def remote_env() -> dict[str, str]:
    """sshd's environment for the remote command: the user's identity and home, the system PATH."""
    env = {"PATH": REMOTE_PATH, "SHELL": "/bin/sh"}
    for key in ("HOME", "USER", "LOGNAME"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def main() -> int:
    args = sys.argv[1:]
    while args and args[0] != "--":
        args = args[2:] if args[0] == "-o" else args[1:]
    host, remote = args[1], " ".join(args[2:])
    with open(os.environ["FAKE_SSH_LOG"], "a") as log:
        log.write(host + "\n")
    if os.environ.get("FAKE_SSH_ARGV_LOG"):
        with open(os.environ["FAKE_SSH_ARGV_LOG"], "a") as log:
            log.write(json.dumps(sys.argv) + "\n")
    child = subprocess.Popen(["/bin/sh", "-c", remote], stdin=subprocess.PIPE, start_new_session=True,
                             env=remote_env())

    def relay() -> None:
        for chunk in iter(lambda: os.read(0, 4096), b""):
            child.stdin.write(chunk)
            child.stdin.flush()  # as ssh forwards at once: the remote side may wait for a line (the secret)
        child.stdin.close()

    threading.Thread(target=relay, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(255))  # the connection drops; child gets EOF
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
