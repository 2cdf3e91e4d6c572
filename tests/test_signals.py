"""SignalWatcher: a signal's work runs on a thread of its own, so a main thread interrupted
inside a lock that work needs does not deadlock (the cause of a master that ignored
``docker stop`` until it was killed, leaving no result)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from click.testing import CliRunner

from dlrover_core import cli
from dlrover_core.signals import SIGNALS_ENV, SignalWatcher, parse_signals, stop_signals


@pytest.mark.timeout(30)
def test_a_signal_arriving_while_the_main_thread_holds_the_callbacks_lock_does_not_deadlock():
    """The main thread holds a plain (non-reentrant) lock when SIGTERM arrives; the callback
    takes that lock. Run in the handler, it would wait for ever on its own thread; on the
    watcher's thread it runs once the main thread lets go."""
    lock = threading.Lock()
    seen: list[tuple[int, str]] = []
    done = threading.Event()

    def callback(signum: int) -> None:
        with lock:
            seen.append((signum, threading.current_thread().name))
        done.set()

    watcher = SignalWatcher(callback).start()
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # the Python handler runs here, in this thread, holding the lock
            assert seen == []
        assert done.wait(10), "the callback never ran"
        assert seen == [(signal.SIGTERM, "dlrover-signals")]
    finally:
        watcher.stop()


@pytest.mark.timeout(30)
def test_stop_restores_the_handlers_and_the_wakeup_fd_that_were_there():
    def before(_signum, _frame):
        pass

    old = signal.signal(signal.SIGUSR1, before)
    try:
        watcher = SignalWatcher(lambda _s: None, signals=(signal.SIGUSR1,)).start()
        assert signal.getsignal(signal.SIGUSR1) is not before
        watcher.stop()
        assert signal.getsignal(signal.SIGUSR1) is before
        assert signal.set_wakeup_fd(-1) == -1  # none was set before: none is left
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_start_outside_the_main_thread_is_refused_with_the_reason():
    errors: list[BaseException] = []

    def start() -> None:
        try:
            SignalWatcher(lambda _s: None).start()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=start)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ValueError) and "main thread" in str(errors[0])


# A process whose main thread writes log lines and an events file under a lock without pause
# (as the master's main loop does), while the test sends it SIGTERMs at random moments; the
# callback logs and writes the same file under the same lock (as master.cancel does). The
# process must answer every signal and exit 0.
_BUSY = textwrap.dedent("""
    import sys, threading, time
    from dlrover_core.logging import configure, get_logger
    from dlrover_core.signals import SignalWatcher
    configure()
    log = get_logger()
    lock = threading.RLock()   # the master's lock is reentrant: a handler would get in
    events = open(sys.argv[1], "a", buffering=1)
    want = int(sys.argv[2])
    got = []
    def on_signal(signum):
        with lock:
            log.info("signal_seen", n=len(got))
            events.write("signal\\n")
            got.append(signum)
    SignalWatcher(on_signal).start()
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while len(got) < want and time.monotonic() < deadline:
        with lock:
            log.info("tick", n=len(got))
            events.write("tick " * 50 + "\\n")
    print("done", len(got), flush=True)
    sys.exit(0 if len(got) == want else 3)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1])
def test_signals_at_random_moments_of_a_busy_logging_main_thread_are_all_answered(tmp_path, seed):
    rng = random.Random(seed)
    want = 40
    proc = subprocess.Popen([sys.executable, "-c", _BUSY, str(tmp_path / "events"), str(want)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for _ in range(want):
            time.sleep(rng.uniform(0.0, 0.03))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)  # (signals sent closer than this may merge into one, as the kernel does)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert (tmp_path / "events").read_text().count("signal\n") == want


def test_stop_signals_are_sigterm_sigint_and_the_launchers_list_else_torchruns_default():
    names = lambda nums: [signal.Signals(n).name for n in nums]  # noqa: E731
    assert names(stop_signals({})) == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    assert names(stop_signals({SIGNALS_ENV: "SIGUSR1, SIGHUP"})) == ["SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP"]
    assert names(stop_signals({SIGNALS_ENV: "SIGTERM,SIGBOGUS,SIGKILL,SIGUSR2"})) == ["SIGTERM", "SIGINT", "SIGUSR2"]
    assert parse_signals("SIGHUP,SIGHUP,SIGTERM") == (signal.SIGHUP, signal.SIGTERM)


@pytest.mark.parametrize(("value", "message"), [("SIGTERM,SIGBOGUS", "'SIGBOGUS' is not a signal name"),
                                                ("SIGKILL", "SIGKILL cannot be handled")])
def test_signals_to_handle_that_no_process_can_handle_are_refused_naming_the_option(tmp_path, value, message):
    script = tmp_path / "train.py"
    script.write_text("")
    result = CliRunner().invoke(cli.main, ["run", "--signals-to-handle", value, str(script)])
    assert result.exit_code == 2, result.output
    assert "--signals-to-handle" in result.output and message in result.output, result.output
