"""``mdb run --processes N``: one supervisor, N container processes on the same settings.

One Python process runs handlers on one core at a time (threads share the
GIL), so a CPU-bound handler needs processes. Each of the N is a whole
container (``mdb run`` with the same settings and ``--port`` selection), with
its own id in ``mdb ports``, competing for the same queues as containers on
several hosts do. The supervisor opens no broker connection and handles no
message: it starts the children, starts a dead one again, and passes a stop on.

- A child that dies (a signal, any exit) is started again after an
  exponential, capped backoff, with a log line naming it, its exit status and
  the delay. One that ran for ``STABLE_AFTER`` before dying starts from the
  first delay again.
- SIGTERM or SIGINT: every child gets SIGTERM once and stops gracefully
  (README: Guarantees, Shutdown); the supervisor exits 0 when all have. A
  second signal kills them (SIGKILL): nothing is acknowledged before its
  outcome commits, so the broker redelivers what they held and nothing is lost.
- Children run in a session of their own, so a terminal's Ctrl-C (SIGINT to
  the foreground process group) reaches the supervisor alone, which passes it
  on once, instead of every child getting it twice.
- No child outlives the supervisor, even one killed with SIGKILL: each asks
  the kernel for SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``)
  and also checks its parent pid every second (any POSIX system), then stops
  gracefully.

The supervisor waits on one thing: a pipe that signals write to
(``signal.set_wakeup_fd``), so a child's death (SIGCHLD), a stop and a due
restart all wake the same loop; its signal handlers only record the signal.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from types import FrameType, TracebackType

import tenacity

from ..errors import MdbError, SettingsError
from ..settings import Settings
from ..state.control import Control
from ..state.store import Store, utcnow
from ..support.failures import describe
from ..support.logs import fields
from ..support.retry import RetryPolicy
from .container import Container

log = logging.getLogger("mdbcontainer.supervisor")

# The project's retry policy (exponential, capped), with delays fit for a process start.
RESTART_BACKOFF = RetryPolicy(initial=0.5, maximum=30.0)
# A child that ran this long before it died is not crash-looping: its backoff starts over.
STABLE_AFTER = 60.0
# How often a child checks that its supervisor still lives (where no death signal exists).
PARENT_CHECK_EVERY = 1.0
# Beyond shutdown_timeout, how long a stopping child may take before it is killed.
KILL_GRACE = 10.0
# How long the supervisor's bookkeeping of killed children may delay its exit.
FORGET_WAIT = 3.0
PR_SET_PDEATHSIG = 1


def validate(settings: Settings, ports: list[str] | None, processes: int) -> None:
    """Refuse what a container process would refuse at start, once, before any child starts.

    It builds what a child builds (``Container``: listeners, bindings, ports,
    ``container.metadata``) without connecting to anything, so a settings or
    listener error is one line from the supervisor, not N children exiting 2.
    """
    container = Container(settings, ports=ports)
    container.store.dispose()
    for binding in container.bindings:
        if binding.settings.durable and processes > 1:
            raise SettingsError(
                f"{settings.source}: ports.{binding.name}: a durable subscription has one active "
                f"subscriber (JMS), so it cannot run in {processes} processes: run it in an mdb run "
                "of its own (--port), and the other ports with --processes"
            )
    metrics = settings.container.metrics_port
    if metrics and metrics + processes - 1 > 65535:
        raise SettingsError(
            f"{settings.source}: container.metrics_port: {metrics} is too high for {processes} "
            f"processes (process N serves on metrics_port + N - 1, at most 65535)"
        )


def exit_status(returncode: int) -> str:
    """How a child ended, as a user reads it: ``killed by SIGKILL`` or ``exited with status 1``."""
    if returncode < 0:
        with suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """The wait after failure ``attempt`` (1, 2, ...), as the policy's tenacity wait computes it."""
    state = tenacity.RetryCallState(tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return float(policy.wait()(state))


@dataclass
class Slot:
    """One of the N container processes: the process running now, and its restart schedule."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    deaths: int = 0  # deaths in a row, each soon after its start: the backoff's attempt number
    restart_at: float | None = None  # when a dead slot starts again (monotonic clock)

    report: int | None = None  # the read end of the pipe the process reports its start on
    started: bool = False  # it reported that its container started
    refusal: str = ""  # the one line of a settings or listener error it reported instead

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def read_report(self) -> None:
        """Take what the process reported (``started``, or ``refused LINE``) and close the pipe."""
        if self.report is None:
            return
        data = b""
        with suppress(BlockingIOError, OSError):
            while chunk := os.read(self.report, 4096):
                data += chunk
        os.close(self.report)
        self.report = None
        for line in data.decode(errors="replace").splitlines():
            kind, _, text = line.partition(" ")
            if kind == STARTED:
                self.started = True
            elif kind == REFUSED:
                self.refusal = text


# What a container process writes on its report pipe (one line each).
STARTED = "started"
REFUSED = "refused"


class Wakeup:
    """Signals recorded by their handlers and written to a pipe that the supervisor's loop waits on."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)

    def __init__(self) -> None:
        self.received: list[int] = []  # SIGTERM and SIGINT, in the order they came

    def __enter__(self) -> Wakeup:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum != signal.SIGCHLD:  # a child's death only has to wake the loop
            self.received.append(signum)

    def wait(self, timeout: float) -> None:
        """Return when a signal came (now or since the last wait), or after ``timeout`` seconds."""
        with suppress(InterruptedError):
            select.select([self._read], [], [], max(0.0, timeout))
        with suppress(BlockingIOError):
            while os.read(self._read, 512):
                pass

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._read)
        os.close(self._write)


class Supervisor:
    """Runs N container processes until SIGTERM or SIGINT, starting dead ones again."""

    def __init__(self, settings: Settings, processes: int, ports: list[str] | None = None, *,
                 backoff: RetryPolicy = RESTART_BACKOFF) -> None:
        validate(settings, ports, processes)
        self.settings = settings
        self.ports = ports or []
        self.backoff = backoff
        self.slots = [Slot(index) for index in range(1, processes + 1)]
        self.store = Store(settings.container)
        self._forgetting: list[threading.Thread] = []
        self._refused: str | None = None  # a child refused the settings before it started

    def run(self) -> int:
        """Start the children and supervise them; 0 after a graceful stop, 130 after a second signal."""
        try:
            with Wakeup() as wakeup:
                for slot in self.slots:
                    self._start(slot)
                log.info("supervisor (pid %d) started %d container processes", os.getpid(),
                         len(self.slots))
                while not wakeup.received and self._refused is None:
                    self._reap()
                    self._start_due()
                    if self._refused is None:
                        wakeup.wait(self._next_timeout())
                code = self._stop_all(wakeup)
        finally:
            for slot in self.slots:
                slot.read_report()
            for thread in self._forgetting:
                thread.join(FORGET_WAIT)
            self.store.dispose()
        if self._refused is not None:  # restarting cannot help: exit 2 with the child's line
            raise SettingsError(self._refused)
        return code

    # -- starting and restarting ----------------------------------------------

    def command(self, index: int) -> list[str]:
        """The child's command line: the same settings file and ports, and who supervises it."""
        args = [sys.executable, "-m", "mdbcontainer", "run", "-c", self.settings.source]
        for port in self.ports:
            args += ["--port", port]
        return [*args, "--supervisor", str(os.getpid()), "--process-index", str(index)]

    def _open_report(self, slot: Slot) -> int:
        """A pipe for ``slot``'s next process to report its start on; returns the write end."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        slot.report, slot.started, slot.refusal = read, False, ""
        return write

    def _environment(self, index: int) -> dict[str, str]:
        env = dict(os.environ)
        metrics = self.settings.container.metrics_port
        if metrics:  # one port per process: process N serves on metrics_port + N - 1
            env["MDB_CONTAINER__METRICS_PORT"] = str(metrics + index - 1)
        return env

    def _start(self, slot: Slot) -> None:
        slot.restart_at = None
        slot.started_at = time.monotonic()
        report = self._open_report(slot)
        command = [*self.command(slot.index), "--report-fd", str(report)]
        try:
            # Its own session: a terminal's Ctrl-C goes to the supervisor, not to each child too.
            slot.proc = subprocess.Popen(command, env=self._environment(slot.index),
                                         start_new_session=True, pass_fds=(report,))
        except OSError as exc:  # no fork today (EAGAIN, ENOMEM): a death like any other
            slot.proc = None
            slot.read_report()
            self._schedule(slot, f"could not be started ({exc.strerror})", None, 0.0)
            return
        finally:
            os.close(report)  # the child holds it now: its end of the pipe ends with it
        log.info("container process %d started (pid %d)", slot.index, slot.proc.pid)

    def _reap(self) -> None:
        """Schedule the restart of every child that died since the last look."""
        for slot in self.slots:
            if slot.proc is None or slot.proc.poll() is None:
                continue
            pid, code = slot.proc.pid, slot.proc.returncode
            slot.proc = None
            self._forget(pid)
            slot.read_report()
            if code == 2 and not slot.started:  # its settings or listeners: a restart cannot help
                self._refused = slot.refusal or (
                    f"container process {slot.index} (pid {pid}) exited with status 2 before it "
                    "started: it refused the settings or listeners (its error is above)")
                return
            self._schedule(slot, exit_status(code), pid, time.monotonic() - slot.started_at)

    def _schedule(self, slot: Slot, status: str, pid: int | None, lived: float) -> None:
        slot.deaths = 1 if lived >= STABLE_AFTER else slot.deaths + 1
        delay = backoff_delay(self.backoff, slot.deaths)
        slot.restart_at = time.monotonic() + delay
        who = f"container process {slot.index}" + (f" (pid {pid})" if pid is not None else "")
        log.warning("%s %s after %.1fs; starting it again in %.1fs", who, status, lived, delay,
                    extra=fields(outcome="restart", reason=status, duration=round(delay, 3)))

    def _start_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.proc is None and slot.restart_at is not None and slot.restart_at <= now:
                self._start(slot)

    def _next_timeout(self) -> float:
        """Until the next restart is due; a second at most (a safety net: SIGCHLD wakes us)."""
        due = [s.restart_at for s in self.slots if s.proc is None and s.restart_at is not None]
        return min([1.0, *(at - time.monotonic() for at in due)])

    def _forget(self, pid: int) -> None:
        """Take a dead child's row off ``mdb ports`` now, off the loop (the database may be slow)."""
        died_at = utcnow()
        thread = threading.Thread(target=self._forget_row, args=(pid, died_at),
                                  name="mdb-forget", daemon=True)
        thread.start()
        self._forgetting = [t for t in self._forgetting if t.is_alive()] + [thread]

    def _forget_row(self, pid: int, died_at: datetime) -> None:
        try:
            Control(self.store, container_id="supervisor").forget_process(pid, died_at)
        except Exception as exc:  # its heartbeat goes stale instead, within seconds
            log.debug("could not remove the row of dead process %d: %s", pid, describe(exc))

    # -- stopping -----------------------------------------------------------

    def _stop_all(self, wakeup: Wakeup) -> int:
        """SIGTERM to every child once; wait for them; a second signal kills them at once."""
        live = [slot for slot in self.slots if slot.alive()]
        if wakeup.received:
            name = signal.Signals(wakeup.received[0]).name
            log.info("%s: stopping %d container process(es) gracefully (again to stop them at once)",
                     name, len(live))
        else:
            log.info("a container process refused the settings before it started: stopping %d "
                     "container process(es) gracefully", len(live))
        for slot in live:
            assert slot.proc is not None
            slot.proc.send_signal(signal.SIGTERM)
        grace = self.settings.container.shutdown_timeout.total_seconds() + KILL_GRACE
        deadline = time.monotonic() + grace
        while live:
            if len(wakeup.received) > (1 if self._refused is None else 0):
                log.warning("second signal: killing %d container process(es); what they held "
                            "unacknowledged will be redelivered", len(live))
                self._kill(live)
                return 130
            if time.monotonic() >= deadline:
                log.warning("%d container process(es) still running %.0fs after SIGTERM: killing "
                            "them; what they held unacknowledged will be redelivered", len(live), grace)
                self._kill(live)
                break
            wakeup.wait(min(1.0, deadline - time.monotonic()))
            live = self._still_running(live)
        log.info("supervisor stopped: every container process has exited")
        return 0

    def _still_running(self, slots: list[Slot]) -> list[Slot]:
        running = []
        for slot in slots:
            assert slot.proc is not None
            if slot.proc.poll() is None:
                running.append(slot)
            else:
                log.info("container process %d (pid %d) %s", slot.index, slot.proc.pid,
                         exit_status(slot.proc.returncode))
        return running

    def _kill(self, slots: list[Slot]) -> None:
        for slot in slots:
            assert slot.proc is not None
            with suppress(ProcessLookupError):
                slot.proc.kill()
        for slot in slots:
            assert slot.proc is not None
            slot.proc.wait()
            self._forget(slot.proc.pid)


# -- the child's side ----------------------------------------------------------


def ask_parent_death_signal(signum: int) -> bool:
    """Linux: have the kernel send ``signum`` to this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def run_supervised(settings: Settings, ports: list[str] | None, supervisor_pid: int,
                   report_fd: int | None = None) -> int:
    """A supervised container process: the container, stopped gracefully when its supervisor is gone.

    ``report_fd``: the pipe it tells its supervisor on that it started, or the one
    line of a settings or listener error that stopped it before (exit 2): the
    supervisor then stops too, with that line, instead of restarting it for ever.
    """
    ask_parent_death_signal(signal.SIGTERM)  # SIGTERM: the container's own graceful stop
    report = Report(report_fd)
    try:
        container = Container(settings, ports=ports)
        watch = threading.Thread(target=stop_when_orphaned, args=(container, supervisor_pid),
                                 name="mdb-supervisor-watch", daemon=True)
        watch.start()  # also catches a supervisor that died before the death signal was asked for
        return container.run(started=report.started)
    except MdbError as exc:
        if exc.exit_code != 2 or report.has_started or not report.refused(str(exc)):
            raise
        return 2
    finally:
        report.close()


class Report:
    """The child's end of its report pipe (none when run by hand with ``--supervisor``)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self.has_started = False

    def _write(self, line: str) -> bool:
        if self.fd is None:
            return False
        try:
            os.write(self.fd, (" ".join(line.split()) + "\n").encode())
        except OSError:
            return False
        return True

    def started(self) -> None:
        self.has_started = True
        self._write(STARTED)

    def refused(self, line: str) -> bool:
        """Tell the supervisor the one line (it prints it, once for every process); False if it cannot."""
        return self._write(f"{REFUSED} {line}")

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with suppress(OSError):
                os.close(fd)


def stop_when_orphaned(container: Container, supervisor_pid: int) -> None:
    """Stop the container when its parent is no longer the supervisor (the portable fallback)."""
    while os.getppid() == supervisor_pid:
        time.sleep(PARENT_CHECK_EVERY)
    log.warning("supervisor (pid %d) is gone: stopping this container gracefully", supervisor_pid)
    container.request_stop()
