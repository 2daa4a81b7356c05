"""Start N local TensorFlow workers with a correct TF_CONFIG each.

    python -m tf_gradsync.launch --num_workers=2 -- examples/multiworker_digits.py --epochs=5

Each worker is `python script.py [args]` in its own process group, with
`TF_CONFIG={"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}`.
Output lines are prefixed with the worker's rank. If a worker exits non-zero the others
are terminated and the launcher exits with that worker's code. A Ctrl-C (SIGINT),
SIGTERM, SIGHUP (the terminal closed) or SIGQUIT that reaches the launcher is forwarded
to every worker as it came, so a worker's own handlers run (a KeyboardInterrupt for
Ctrl-C). TensorFlow installs its own SIGTERM handler, so a worker may ignore the signal:
after `--grace_seconds` the whole process group gets SIGKILL, and no process is left
behind. On Linux a worker also gets SIGKILL when the launcher dies without stopping it
(killed with SIGKILL itself, or out of memory); processes the worker started are then
left to it. (`Job` asks for that only when started from the main thread, and a prefix
that forks, or runs a setuid program, does not pass it on.)

`--restarts=K` re-runs the whole job after a failure, up to K times: every worker is
stopped, then all start again (on fresh free ports unless `--port` is given) with
`TF_GRADSYNC_ATTEMPT` set to the attempt number (0 for the first run), so a script can
resume from a backup (e.g. Keras `BackupAndRestore`). When the last attempt fails the
launcher exits with its code. `--attempt_timeout` bounds each attempt; one that runs
longer is stopped and counts as failed (exit code 124).

The workers share this machine's cores, so each gets its share of them for
TensorFlow's intra-op thread pool (`TF_NUM_INTRAOP_THREADS`: cores // N, at least 1,
unless the environment sets it; `--threads_per_worker` overrides, 0 keeps TensorFlow's
default of every core). Every worker's parallel ops, XLA's loops included, split their
work over that pool and wait for its slowest part: with more threads than cores
across the workers, a part whose thread is not running holds the op up. 8 workers on 2
cores, a 1M-parameter model, loopback: int8's step 0.141 -> 0.095 s, QSGD's 0.222 ->
0.101, stock's 0.113 -> 0.099 (BENCHMARKS.md).

For several machines, `--print_tf_config --hosts=h1,h2 --port=P` prints the TF_CONFIG to
export on each host. Worker addresses are 127.0.0.1 (and free ports are probed there)
unless `--hosts` names other addresses of this machine (the workers start here; other
machines' only with `--print_tf_config`). TensorFlow's gRPC server is unauthenticated and
unencrypted, and listens on every interface whatever host the address names: run
workers only on a trusted network.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

#: Set in every worker's environment: the attempt it belongs to (0, then 1.. on restarts).
ATTEMPT_ENV = "TF_GRADSYNC_ATTEMPT"
#: The variable giving each worker's TensorFlow its intra-op threads (`thread_env`).
THREADS_ENV = "TF_NUM_INTRAOP_THREADS"
#: Exit code of an attempt stopped by `--attempt_timeout` (as coreutils' `timeout`).
TIMEOUT_CODE = 124
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)$")
#: Runs first in each worker's process, then becomes the worker's command (argv: the
#: launcher's pid, then the command): Linux sends the worker SIGKILL when the thread that
#: started it ends, so a launcher that dies without a chance to stop its workers (SIGKILL)
#: leaves none behind (`prctl(PR_SET_PDEATHSIG)`, kept across exec). A launcher that
#: died before the call is seen as a new parent pid.
_PARENT_DEATH_GUARD = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Ports that were free a moment ago (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ports_in_use(ports: Sequence[int], host: str = "") -> list[int]:
    """Those of `ports` that a server cannot listen on at `host` now (by default every
    interface, where TensorFlow's gRPC server listens; with SO_REUSEADDR, as it binds)."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))      # "" (every interface) as gRPC's server binds
                s.listen(1)
            except OSError:
                busy.append(port)
    return busy


def tf_configs(addresses: Sequence[str]) -> list[dict]:
    """One TF_CONFIG dict per worker for a cluster of `addresses` ("host:port")."""
    return [{"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": i}}
            for i in range(len(addresses))]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses and validates the launcher's command line.

    Raises:
      SystemExit: (via argparse) with a message naming the bad value and what is allowed.
    """
    p = argparse.ArgumentParser(prog="python -m tf_gradsync.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_workers", type=int, required=True, help="workers to start (>= 1)")
    p.add_argument("--port", type=int, default=None,
                   help="first port; worker i uses port+i (default: free ports)")
    p.add_argument("--hosts", default=None,
                   help="comma-separated host per worker (default: 127.0.0.1 for all)")
    p.add_argument("--print_tf_config", action="store_true",
                   help="print each worker's TF_CONFIG and exit")
    p.add_argument("--grace_seconds", type=float, default=10.0,
                   help="wait this long after SIGTERM before SIGKILL (> 0)")
    p.add_argument("--restarts", type=int, default=0,
                   help="restart the whole job up to this many times after a failure (>= 0); "
                        f"workers see the attempt number in ${ATTEMPT_ENV}")
    p.add_argument("--attempt_timeout", type=float, default=None,
                   help="stop an attempt that runs longer than this many seconds (> 0); it "
                        f"counts as failed with exit code {TIMEOUT_CODE} (default: no limit)")
    p.add_argument("--threads_per_worker", type=int, default=None,
                   help=f"intra-op threads of each worker's TensorFlow (>= 0; default: "
                        f"${THREADS_ENV} if set, else this machine's cores // num_workers, at "
                        "least 1; 0: TensorFlow's default, every core)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- script.py [args] (a leading python is this interpreter)")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.command and re.fullmatch(r"python[0-9.]*", os.path.basename(args.command[0])):
        # `-- python train.py`, as other launchers are called: the workers run this
        # launcher's interpreter whatever is named.
        args.command = args.command[1:]
    if args.num_workers < 1:
        p.error(f"--num_workers must be >= 1, got {args.num_workers}")
    # Worker i listens on port + i, and the last of them on 65535 at most.
    if args.port is not None and not 1 <= args.port <= 65536 - args.num_workers:
        p.error(f"--port must be in 1..{65536 - args.num_workers}, got {args.port}")
    if not 0 < args.grace_seconds < math.inf:
        p.error(f"--grace_seconds must be a finite number > 0, got {args.grace_seconds}")
    if args.threads_per_worker is not None and args.threads_per_worker < 0:
        p.error(f"--threads_per_worker must be >= 0, got {args.threads_per_worker}")
    if args.restarts < 0:
        p.error(f"--restarts must be >= 0, got {args.restarts}")
    if args.attempt_timeout is not None and not 0 < args.attempt_timeout < math.inf:
        p.error(f"--attempt_timeout must be a finite number > 0, got {args.attempt_timeout}")
    hosts = args.hosts.split(",") if args.hosts else ["127.0.0.1"] * args.num_workers
    if len(hosts) != args.num_workers or not all(hosts):
        p.error(f"--hosts must name {args.num_workers} non-empty hosts, got {args.hosts!r}")
    bad = [h for h in hosts if not _HOST.match(h)]
    if bad:
        p.error(f"--hosts has {bad[0]!r}; allowed: host names or IP addresses without a port "
                "([...] for IPv6), separated by commas")
    args.hosts = hosts
    if args.print_tf_config:
        if args.port is None and args.hosts != ["127.0.0.1"] * args.num_workers:
            p.error("--print_tf_config for remote hosts needs --port")
        return args
    if not args.command:
        p.error("give the worker command after --, e.g. -- train.py --epochs=3")
    # Every worker starts here: an address of another machine would leave them waiting
    # for peers that are not there until their startup bound.
    remote = [h for h in dict.fromkeys(hosts) if not _of_this_machine(h)]
    if remote:
        p.error(f"--hosts names {', '.join(remote)}, not addresses of this machine, and this "
                "launcher starts every worker here; for several machines print each one's "
                "TF_CONFIG with --print_tf_config --port=P and start the workers there")
    script = args.command[0]
    if script.endswith(".py") and not os.path.isfile(script):
        p.error(f"no such script {script!r} (from {os.getcwd()})")
    return args


def _of_this_machine(host: str) -> bool:
    """Whether a worker here can listen on `host` (an address of one of this machine's
    interfaces, or a name of one)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(address)
            return True
        except OSError:
            continue
    return False


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one): what
    the local workers share."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_env(workers: int, threads: int | None = None) -> dict[str, str]:
    """The environment that sizes each of `workers` local workers' intra-op thread pool:
    `threads` (0: none, TensorFlow's default), or, when None, what the environment
    already sets, else this process's cores // workers (at least 1).

    Args:
      workers: workers started on this machine (>= 1).
      threads: threads per worker, or None for the default.

    Returns:
      `{THREADS_ENV: "k"}`, or {} to leave TensorFlow's default.

    Example:
      >>> thread_env(8, 1)
      {'TF_NUM_INTRAOP_THREADS': '1'}
    """
    if threads is None:
        if THREADS_ENV in os.environ:
            return {}
        threads = max(1, cores() // workers)
    return {THREADS_ENV: str(threads)} if threads else {}


class Job:
    """A set of worker processes that live and die together."""

    def __init__(self, command: Sequence[str], configs: Sequence[dict], grace_seconds: float,
                 out=sys.stdout, prefixes: Sequence[Sequence[str]] | None = None,
                 env: dict[str, str] | None = None, threads: int | None = None):
        """Starts one `python command` per TF_CONFIG in `configs`, all on this machine.

        Args:
          command: the Python arguments (script or `-m module`, then its flags).
          configs: one TF_CONFIG dict per worker.
          grace_seconds: SIGTERM-to-SIGKILL delay of `stop`.
          out: where the rank-prefixed output lines go.
          prefixes: per worker, a command that runs Python (e.g. `ip netns exec NS`).
          env: variables added to this process's environment for every worker.
          threads: intra-op threads per worker (`thread_env`; None: cores // workers
            unless the environment or `env` sets them, 0: TensorFlow's default).
        """
        self.grace_seconds = grace_seconds
        self._out = out
        self._lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        #: The rank of the worker whose failure ended the job (`wait`), if one did.
        self.failed_rank: int | None = None
        #: Then, what the other workers were doing: "still running", "had exited 0" or
        #: "failed too (exit code N)"; `failed_rank` is the lowest rank that had failed.
        self.others_at_failure: dict[int, str] = {}
        env = dict(env or {})
        if THREADS_ENV not in env:
            env.update(thread_env(len(configs), threads))
        # The signal follows the starting thread, not the process: a Job started from
        # another thread would lose its workers when that thread ends.
        guard = [sys.executable, "-S", "-c", _PARENT_DEATH_GUARD, str(os.getpid())] \
            if sys.platform.startswith("linux") \
            and threading.current_thread() is threading.main_thread() else []
        for rank, cfg in enumerate(configs):
            wenv = dict(os.environ, **env, TF_CONFIG=json.dumps(cfg), PYTHONUNBUFFERED="1")
            prefix = list(prefixes[rank]) if prefixes else []
            proc = subprocess.Popen([*guard, *prefix, sys.executable, *command], env=wenv,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.procs.append(proc)
        self._threads = [threading.Thread(target=self._pump, args=(r, p), daemon=True)
                         for r, p in enumerate(self.procs)]
        for t in self._threads:
            t.start()

    def _pump(self, rank: int, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                try:
                    print(f"[{rank}] {line}", file=self._out, flush=True)
                except (OSError, ValueError):
                    # The terminal is gone (SIGHUP): drain on, so that no worker blocks
                    # on a full pipe.
                    pass

    def wait(self, timeout: float | None = None) -> int:
        """Waits until all workers exit 0 (-> 0) or one fails (-> its code, others stopped).

        Raises:
          TimeoutError: after `timeout` seconds (if given), once every worker is stopped.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            expired = deadline is not None and time.monotonic() > deadline
            codes = [p.poll() for p in self.procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The one that failed may be a victim: a peer stuck (still running) or
                # gone early (exited 0) leaves the others' collectives to time out.
                self.others_at_failure = {
                    r: ("still running" if c is None else "had exited 0" if c == 0
                        else f"failed too (exit code {c if c > 0 else 128 - c})")
                    for r, c in enumerate(codes) if r != failed[0]}
                self.stop()
                self.failed_rank, code = failed[0], codes[failed[0]]
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                self._drain()
                return 0
            if expired:
                running = [r for r, c in enumerate(codes) if c is None]
                self.stop()
                raise TimeoutError(f"worker(s) {', '.join(map(str, running))} still running "
                                   f"after {timeout:g} s; stopped them")
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, sig: int | None = None) -> None:
        """`sig` (SIGTERM by default) to every process group, then SIGKILL after the
        grace period."""
        self.signal(signal.SIGTERM if sig is None else sig)
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        # Kill the groups even if the leader exited: its children may still run.
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=self.grace_seconds)
            except subprocess.TimeoutExpired:   # e.g. stuck in uninterruptible I/O
                print(f"[launch] process {p.pid} did not exit after SIGKILL", file=sys.stderr,
                      flush=True)
        self._drain()

    def _drain(self) -> None:
        for t in self._threads:
            t.join(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher; returns the exit code (0, a worker's code, 124, or 128 + signal)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    n = args.num_workers

    def addresses() -> list[str]:
        ports = [args.port + i for i in range(n)] if args.port is not None else free_ports(n)
        return [f"{h}:{p}" for h, p in zip(args.hosts, ports)]

    if args.print_tf_config:
        for h, cfg in zip(args.hosts, tf_configs(addresses())):
            print(f"{h}: TF_CONFIG='{json.dumps(cfg)}'")
        return 0
    local = [args.port + i for i, h in enumerate(args.hosts) if h == "127.0.0.1"] \
        if args.port is not None else []
    busy = ports_in_use(local)
    if busy:
        # TensorFlow's own error would name no port.
        print(f"[launch] --port={args.port}: port(s) {', '.join(map(str, busy))} of this "
              "machine are in use; pick another --port or leave it out (free ports)",
              file=sys.stderr, flush=True)
        return 2
    job: Job | None = None
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        if job is not None:
            job.stop(signum)
    # A signal this process ignores stays ignored (`nohup` ignores SIGHUP, a shell
    # SIGINT for a background job): the workers go on when it comes.
    old = {s: signal.signal(s, forward)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
           if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        for attempt in range(args.restarts + 1):
            # Free ports are probed again for every attempt: the previous attempt's may
            # still be held by sockets in TIME_WAIT.
            job = Job(args.command, tf_configs(addresses()), args.grace_seconds,
                      env={ATTEMPT_ENV: str(attempt)}, threads=args.threads_per_worker)
            if received:      # a signal that arrived while the workers were starting
                job.stop(received[0])
                break
            try:
                code = job.wait(args.attempt_timeout)
            except TimeoutError as e:
                print(f"[launch] attempt {attempt}: {e}", file=sys.stderr, flush=True)
                code = TIMEOUT_CODE
            if received or code == 0:
                break
            left = args.restarts - attempt
            who = "" if job.failed_rank is None else f" (worker {job.failed_rank}" + "".join(
                f"; worker {r} {state}" for r, state in job.others_at_failure.items()) + ")"
            print(f"[launch] attempt {attempt} failed with exit code {code}{who}; "
                  + (f"restarting ({left} restart(s) left)" if left else "no restarts left"),
                  file=sys.stderr, flush=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 + received[0] if received else code


if __name__ == "__main__":
    sys.exit(main())
