"""Run the ranks as local child processes (ssh, `ip netns exec` or the program itself) and supervise them.

Every output line is prefixed with its rank. What a rank's failure does is the job's `on_failure`:

- "stop" (the default): the first rank to fail stops all the others (SIGTERM to each rank's process group,
  SIGKILL after a grace period) and its exit code becomes the launcher's.
- "shrink": for a job whose ranks go on without a lost one (`dist.shrink_group`). A rank that fails while
  others still run and none has finished yet is *lost*: it is reported and the others run on. Once every
  rank has ended, the launcher exits 0 when the ranks that were not lost all exited 0, and says which
  were lost; a rank failing after another finished (the job was ending) or as the last one standing is
  a failure, and the first such rank's code becomes the launcher's. No rank is stopped because another
  ended.

Ctrl-C (or SIGTERM/SIGHUP to the launcher) stops everything and returns 130.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Iterator, Mapping, Sequence

from ..errors import ConfigError
from .ranks import RankSpec

DEFAULT_GRACE = 5.0
ON_FAILURE = ("stop", "shrink")  # what a rank's failure does to the others (the module docstring)


def exit_code(returncode: int) -> int:
    """Popen's -N (killed by signal N) becomes the shell's 128+N."""
    return returncode if returncode >= 0 else 128 - returncode


def describe_code(code: int) -> str:
    """`code` as the launcher reports it: "code 137, killed by SIGKILL" for the shell's 128+N."""
    if 128 < code < 128 + signal.NSIG:
        with contextlib.suppress(ValueError):
            return f"code {code}, killed by {signal.Signals(code - 128).name}"
    return f"code {code}"


def prefix_lines(stream: IO[bytes], label: str, sink: IO[str], lock: threading.Lock) -> None:
    """Copy `stream` to `sink` line by line as `[label] line` (a final unterminated line included)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with lock:
            sink.write(f"[{label}] {line}\n")
            sink.flush()


def start_rank(spec: RankSpec, base_env: Mapping[str, str]) -> subprocess.Popen:
    env = dict(base_env)
    if not spec.env_in_argv:
        env.update(spec.env)
        env.update(spec.private_env)
    try:
        # Own session per rank: the terminal's Ctrl-C reaches only us, and we can kill the rank's whole
        # process group (its children too). ssh ranks get a stdin pipe we never close until the end:
        # the remote side treats EOF on it as "launcher gone".
        proc = subprocess.Popen(spec.argv, env=env, cwd=spec.cwd, start_new_session=True,
                                stdin=subprocess.PIPE if spec.env_in_argv else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise ConfigError(f"cannot start {spec.label} on {spec.host.name}: `{spec.argv[0]}` not found") from None
    except PermissionError:
        raise ConfigError(f"cannot start {spec.label} on {spec.host.name}: `{spec.argv[0]}` is not "
                          "executable (or `ip netns exec` needs root)") from None
    preamble = spec.stdin_preamble()  # the private env of an ssh rank: its remote script reads it first
    if preamble:
        write_unbuffered(proc.stdin, preamble)
    return proc


def write_unbuffered(pipe: IO[bytes], data: bytes) -> None:
    """Write `data` straight to the pipe's descriptor, bypassing its buffer. An ssh that fails at once (an
    unknown host, no key) exits without reading its stdin: the write then fails with EPIPE, which is fine
    (ssh's exit code tells the supervisor why). Through the buffered writer the unsent bytes would stay in
    its buffer, and closing the pipe at the end would try them again and raise BrokenPipeError there."""
    view = memoryview(data)
    try:
        while view:  # a few bytes: one write, which never blocks on an empty pipe
            view = view[os.write(pipe.fileno(), view):]
    except (BrokenPipeError, ConnectionResetError):
        pass


SSH_FAILED = 255  # what ssh exits with when it could not run the command (connection, host key, auth)


def failure_hint(spec: RankSpec, code: int) -> str:
    """What to check when an ssh rank failed before its program could run."""
    if spec.host.exec != "ssh" or code != SSH_FAILED:
        return ""
    target = spec.host.ssh
    return (f"; ssh to {target} failed (exit {SSH_FAILED}: its own message is above). Check that the name "
            f"{target} is right and resolves from here, that Remote Login is on for your user on {spec.host.name} "
            f"(System Settings > General > Sharing), and that `ssh -o BatchMode=yes {target} true` succeeds "
            "without a password prompt (your key is in that Mac's ~/.ssh/authorized_keys, and its host key is "
            "in your known_hosts)")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live rank, wait up to `grace` seconds in total, then SIGKILL the rest."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def first_failure(procs: Sequence[subprocess.Popen], poll_interval: float) -> int | None:
    """Block until every rank has succeeded (-> None) or one has failed (-> its index)."""
    while True:
        running = False
        for i, proc in enumerate(procs):
            rc = proc.poll()
            if rc is None:
                running = True
            elif rc != 0:
                return i
        if not running:
            return None
        time.sleep(poll_interval)


@dataclass
class Shrinking:
    """What the ranks of an on_failure="shrink" job did, as they end (see the module docstring)."""
    world: int
    finished: list[int] = field(default_factory=list)  # exited 0
    lost: list[tuple[int, int]] = field(default_factory=list)  # (rank index, exit code)
    failed: list[tuple[int, int]] = field(default_factory=list)

    def ended(self, index: int, code: int, running: int) -> str:
        """Record rank `index` ending with `code` while `running` others still run; -> its kind."""
        if code == 0:
            self.finished.append(index)
            return "finished"
        if running and not self.finished:
            self.lost.append((index, code))
            return "lost"
        self.failed.append((index, code))
        return "failed"

    def code(self) -> int:
        return self.failed[0][1] if self.failed else 0

    def summary(self, specs: Sequence[RankSpec]) -> str | None:
        """The launcher's last line when the job lost ranks (None when it lost none)."""
        if not self.lost:
            return None
        lost = ", ".join(f"{specs[i].label} on {specs[i].host.name} (exit {describe_code(c)})" for i, c in self.lost)
        left = self.world - len(self.lost)
        if self.failed:
            return (f"the job shrank from {self.world} to {left} rank(s) (lost {lost}), then "
                    f"{specs[self.failed[0][0]].label} failed: exit code {self.code()}")
        done = ", ".join(str(specs[i].rank) for i in sorted(self.finished))
        return f"the job shrank from {self.world} to {left} rank(s): lost {lost}; rank(s) {done} finished with code 0"


def wait_shrinking(specs: Sequence[RankSpec], procs: Sequence[subprocess.Popen], poll_interval: float,
                   say: Callable[[str], None]) -> Shrinking:
    """Block until every rank has ended, reporting each loss and failure as it happens."""
    job = Shrinking(len(procs))
    pending = set(range(len(procs)))
    while pending:
        for i in sorted(pending):
            rc = procs[i].poll()
            if rc is None:
                continue
            pending.discard(i)
            code = exit_code(rc)
            running = sum(p.poll() is None for p in procs)
            kind = job.ended(i, code, running)
            spec = specs[i]
            if kind == "lost":
                say(f"{spec.label} on {spec.host.name} exited with {describe_code(code)}"
                    f"{failure_hint(spec, code)}; lost: the job goes on without it, {running} rank(s) still "
                    "running (--on-failure shrink)")
            elif kind == "failed":
                say(f"{spec.label} on {spec.host.name} exited with {describe_code(code)}"
                    f"{failure_hint(spec, code)}" + (" after the job shrank" if job.lost else ""))
        if pending:
            time.sleep(poll_interval)
    return job


@contextlib.contextmanager
def _interrupt_on_termination() -> Iterator[None]:
    """Treat SIGTERM/SIGHUP to the launcher like Ctrl-C, so the ranks are stopped rather than orphaned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


def supervise(specs: Sequence[RankSpec], *, grace: float = DEFAULT_GRACE, poll_interval: float = 0.05,
              stdout: IO[str] | None = None, stderr: IO[str] | None = None,
              base_env: Mapping[str, str] | None = None, log: Callable[[str], None] | None = None,
              on_failure: str = "stop") -> int:
    """Run all ranks to completion; -> 0, the first failed rank's exit code, or 130 when interrupted.
    `on_failure`: one of ON_FAILURE (the module docstring)."""
    if on_failure not in ON_FAILURE:
        raise ConfigError(f"--on-failure {on_failure!r} is invalid: expected one of {', '.join(ON_FAILURE)}")
    out, err = stdout or sys.stdout, stderr or sys.stderr
    say = log or (lambda msg: print(f"torch-thunderbolt launch: {msg}", file=err, flush=True))
    env = dict(os.environ if base_env is None else base_env)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        with _interrupt_on_termination():
            for spec in specs:
                proc = start_rank(spec, env)
                procs.append(proc)
                for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
                    t = threading.Thread(target=prefix_lines, args=(stream, spec.label, sink, lock), daemon=True)
                    t.start()
                    pumps.append(t)
            if on_failure == "shrink":
                job = wait_shrinking(specs, procs, poll_interval, say)
                for t in pumps:
                    t.join(timeout=2.0)  # the ranks' last lines before the summary
                summary = job.summary(specs)
                if summary:
                    say(summary)
                return job.code()
            failed = first_failure(procs, poll_interval)
            if failed is None:
                return 0
            spec, code = specs[failed], exit_code(procs[failed].returncode)
            others = sum(p.poll() is None for p in procs)
            say(f"{spec.label} on {spec.host.name} exited with code {code}{failure_hint(spec, code)}; "
                f"stopping {others} other rank(s)")
            stop_all(procs, grace)
            return code
    except KeyboardInterrupt:
        say("interrupted; stopping all ranks")
        stop_all(procs, grace)
        return 130
    finally:
        stop_all(procs, grace)
        for t in pumps:
            t.join(timeout=2.0)  # a grandchild holding the pipe open must not hang us
        for proc in procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(BrokenPipeError):  # nothing is buffered; this is belt and braces
                        stream.close()
