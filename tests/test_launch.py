"""The launcher: TF_CONFIG, output prefixes, exit codes, signals, flag validation."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tf_gradsync import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


def run(args, timeout=60):
    return subprocess.run([sys.executable, "-m", "tf_gradsync.launch", *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_each_worker_gets_its_tf_config_and_a_rank_prefix(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import os, json; c = json.loads(os.environ['TF_CONFIG']);"
                      "print(c['task']['index'], len(c['cluster']['worker']), "
                      "c['cluster']['worker'][c['task']['index']])")
    out = run(["--num_workers=3", "--", str(script)])
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert [l.split()[:3] for l in lines] == [["[0]", "0", "3"], ["[1]", "1", "3"], ["[2]", "2", "3"]]
    addrs = [l.split()[3] for l in lines]
    assert len(set(addrs)) == 3 and all(a.startswith("127.0.0.1:") for a in addrs)


@pytest.mark.parametrize("interpreter", ["python", "python3", "/usr/bin/python3.11"])
def test_a_named_interpreter_runs_as_this_one(tmp_path, interpreter):
    """`-- python train.py`, as other launchers take it: the workers run the launcher's
    interpreter."""
    script = tmp_path / "w.py"
    script.write_text("import sys; print(sys.executable)")
    out = run(["--num_workers=1", "--", interpreter, str(script)])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[0]", sys.executable]


def test_failure_stops_the_others_and_returns_its_code(tmp_path):
    script = tmp_path / "w.py"
    # Worker 1 fails; worker 0 ignores SIGTERM (as TensorFlow workers may) and would
    # sleep for ten minutes: it must be killed after the grace period.
    script.write_text((
        "import os, json, signal, time, sys\n"
        "r = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('pid', os.getpid(), flush=True)\n"
        "time.sleep(0.5)\n"
        "sys.exit(7) if r == 1 else time.sleep(600)\n"))
    start = time.monotonic()
    out = run(["--num_workers=2", "--grace_seconds=1", "--", str(script)])
    assert out.returncode == 7
    # Worker 0, still running when worker 1 failed, is named too: it may be the cause.
    assert ("[launch] attempt 0 failed with exit code 7 (worker 1; worker 0 still running); "
            "no restarts left") in out.stderr
    assert time.monotonic() - start < 30
    pids = [int(l.split()[-1]) for l in out.stdout.splitlines() if " pid " in l]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_launcher_killed_outright(tmp_path):
    """A launcher killed with SIGKILL cannot stop its workers; Linux kills them for it."""
    script = tmp_path / "w.py"
    script.write_text("import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-m", "tf_gradsync.launch", "--num_workers=2",
                             "--", str(script)], env=ENV, stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, "the launcher exited before its workers started"
            pids.append(int(line.split()[-1]))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.1)
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their launcher"


def _running(pid):
    """Whether `pid` runs (and is no zombie: the init process reaps orphans late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _default_signals():
    """The dispositions of a launcher started from a terminal: a background job (as the
    suite may run) inherits SIGINT and SIGQUIT ignored, and `nohup` SIGHUP, which the
    launcher then leaves ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_is_forwarded_as_it_came(tmp_path, sig):
    """Each worker gets the launcher's signal itself, not SIGTERM for all: a Ctrl-C is a
    KeyboardInterrupt in the workers, and a closed terminal (SIGHUP) or SIGQUIT stops
    them too instead of leaving them running."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):\n"
        "    signal.signal(s, lambda n, f: (print('got', n, flush=True), sys.exit(3)))\n"
        "try:\n"
        "    print('up', os.getpid(), flush=True)\n"
        "    time.sleep(600)\n"
        "except KeyboardInterrupt:\n"
        "    print('got', int(signal.SIGINT), flush=True)\n"
        "    sys.exit(3)\n")
    proc = subprocess.Popen([sys.executable, "-m", "tf_gradsync.launch", "--num_workers=2",
                             "--grace_seconds=20", "--", str(script)], env=ENV,
                            stdout=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    pids = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        if " up " in line:
            pids.append(int(line.split()[-1]))
    start = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 128 + sig
    # The workers' handlers ran (well within the grace period: no SIGKILL needed).
    assert proc.stdout.read().count(f"got {int(sig)}") == 2
    assert time.monotonic() - start < 15
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_signal_the_launcher_ignores_stays_ignored(tmp_path):
    """Under `nohup` (SIGHUP ignored) a closed terminal stops nothing."""
    script = tmp_path / "w.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "tf_gradsync.launch", "--num_workers=2",
                             "--grace_seconds=1", "--", str(script)], env=ENV,
                            stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    seen = 0
    while seen < 2:
        seen += "up" in proc.stdout.readline()
    proc.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM


def test_a_port_in_use_is_named_before_any_worker_starts(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("print('started', flush=True)")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        out = run(["--num_workers=1", f"--port={port}", "--", str(script)])
    assert out.returncode == 2
    assert f"port(s) {port} of this machine are in use" in out.stderr, out.stderr
    assert "started" not in out.stdout


def test_print_tf_config_for_hosts():
    out = run(["--num_workers=2", "--hosts=a,b", "--port=2222", "--print_tf_config"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    cfg = json.loads(lines[1].split("TF_CONFIG=", 1)[1].strip("'"))
    assert cfg == {"cluster": {"worker": ["a:2222", "b:2223"]}, "task": {"type": "worker", "index": 1}}
    # The last worker may take the last port.
    out = run(["--num_workers=2", "--hosts=a,b", "--port=65534", "--print_tf_config"])
    assert out.returncode == 0, out.stderr
    assert '"b:65535"' in out.stdout


@pytest.mark.parametrize("flags,env,expected", [
    ([], {}, str(max(1, len(os.sched_getaffinity(0)) // 3))),   # the cores shared out
    (["--threads_per_worker=0"], {}, None),                         # TensorFlow's default
    (["--threads_per_worker=5"], {launch.THREADS_ENV: "7"}, "5"),
    ([], {launch.THREADS_ENV: "7"}, "7"),                           # the user's setting kept
])
def test_workers_share_the_cores_between_their_thread_pools(tmp_path, flags, env, expected):
    script = tmp_path / "w.py"
    script.write_text(f"import os; print(os.environ.get({launch.THREADS_ENV!r}))")
    base = {k: v for k, v in ENV.items() if k != launch.THREADS_ENV}
    out = subprocess.run([sys.executable, "-m", "tf_gradsync.launch", "--num_workers=3", *flags,
                          "--", str(script)], env=dict(base, **env), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [l.split()[1] for l in out.stdout.splitlines()] == [str(expected)] * 3


def test_thread_env():
    assert launch.thread_env(4, 2) == {launch.THREADS_ENV: "2"}
    assert launch.thread_env(4, 0) == {}
    assert launch.thread_env(10 ** 6) == ({} if launch.THREADS_ENV in os.environ
                                          else {launch.THREADS_ENV: "1"})


@pytest.mark.parametrize("args,message", [
    (["--num_workers=0", "--", "x.py"], "--num_workers must be >= 1, got 0"),
    (["--num_workers=2", "--port=70000", "--", "x.py"], "--port must be in 1..65534, got 70000"),
    (["--num_workers=2", "--port=65535", "--", "x.py"], "--port must be in 1..65534, got 65535"),
    (["--num_workers=2", "--hosts=a", "--", "x.py"], "--hosts must name 2 non-empty hosts, got 'a'"),
    (["--num_workers=2", "--grace_seconds=0", "--", "x.py"],
     "--grace_seconds must be a finite number > 0, got 0.0"),
    (["--num_workers=2"], "give the worker command after --"),
    (["--num_workers=2", "--threads_per_worker=-1", "--", "x.py"],
     "--threads_per_worker must be >= 0, got -1"),
    # TEST-NET: no interface of this machine has it.
    (["--num_workers=2", "--hosts=127.0.0.1,192.0.2.1", "--", __file__],
     "--hosts names 192.0.2.1, not addresses of this machine, and this launcher starts every "
     "worker here; for several machines print each one's TF_CONFIG with --print_tf_config"),
    (["--num_workers=2", "--", "no_such_train.py"], "no such script 'no_such_train.py'"),
])
def test_bad_flags(args, message, capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(args)
    assert message in capsys.readouterr().err


def test_hosts_of_this_machine_start_here():
    args = launch.parse_args(["--num_workers=2", "--hosts=localhost,127.0.0.1", "--", __file__])
    assert args.hosts == ["localhost", "127.0.0.1"]


def test_tf_configs():
    cfgs = launch.tf_configs(["h:1", "h:2"])
    assert cfgs[0]["task"] == {"type": "worker", "index": 0}
    assert cfgs[1]["cluster"]["worker"] == ["h:1", "h:2"]


# ------------------------------------------------------------ restarts
# Rank 1 fails in the first attempts, once rank 0 has started (a file says so: on a
# loaded machine rank 0 may otherwise be stopped before it prints anything).
FLAKY = (
    "import json, os, sys, time\n"
    "rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    "attempt = int(os.environ['TF_GRADSYNC_ATTEMPT'])\n"
    "print('attempt', attempt, 'rank', rank, os.environ['TF_CONFIG'], flush=True)\n"
    "fail_until = int(sys.argv[1])\n"
    "started = os.path.join(os.path.dirname(os.path.abspath(__file__)), f'started_{attempt}')\n"
    "if rank == 0:\n"
    "    open(started, 'w').close()\n"
    "if rank == 1 and attempt < fail_until:\n"
    "    deadline = time.monotonic() + 60\n"
    "    while not os.path.exists(started) and time.monotonic() < deadline:\n"
    "        time.sleep(0.05)\n"
    "    sys.exit(5)\n"
    "time.sleep(0.5 if rank == 1 else 600 if attempt < fail_until else 0)\n")


def attempts(stdout):
    """{attempt: {rank: TF_CONFIG}} from the FLAKY workers' output."""
    seen = {}
    for line in stdout.splitlines():
        _, word, attempt, _, rank, cfg = line.split(" ", 5)
        assert word == "attempt"
        seen.setdefault(int(attempt), {})[int(rank)] = json.loads(cfg)
    return seen


@pytest.mark.parametrize("restarts,fail_until,code,runs", [
    (0, 1, 5, 1),      # no restarts: the failing worker's code, at once
    (1, 1, 0, 2),      # the second attempt succeeds
    (2, 5, 5, 3),      # exhausted: the last attempt's code
])
def test_restarts(tmp_path, restarts, fail_until, code, runs):
    script = tmp_path / "w.py"
    script.write_text(FLAKY)
    out = run(["--num_workers=2", f"--restarts={restarts}", "--grace_seconds=1", "--",
               str(script), str(fail_until)], timeout=120)
    assert out.returncode == code, out.stderr[-2000:]
    seen = attempts(out.stdout)
    assert sorted(seen) == list(range(runs)) and all(sorted(s) == [0, 1] for s in seen.values())
    # Every attempt is a whole new cluster: both workers, fresh ports on 127.0.0.1.
    clusters = [tuple(seen[a][0]["cluster"]["worker"]) for a in range(runs)]
    assert all(seen[a][1]["cluster"]["worker"] == list(clusters[a]) for a in range(runs))
    assert len(set(clusters)) == runs
    assert all(addr.startswith("127.0.0.1:") for c in clusters for addr in c)
    failures = [l for l in out.stderr.splitlines() if l.startswith("[launch] attempt")]
    assert len(failures) == runs - (code == 0)
    if code:
        assert re.search(rf"failed with exit code {code} \(worker 1(; worker 0 (still running"
                         r"|had exited 0|failed too \(exit code \d+\)))?\); no restarts left$",
                         failures[-1]), failures[-1]


def test_attempt_timeout_stops_a_hung_job(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import time; print('up', flush=True); time.sleep(600)")
    start = time.monotonic()
    out = run(["--num_workers=2", "--restarts=1", "--attempt_timeout=2", "--grace_seconds=1",
               "--", str(script)], timeout=120)
    assert out.returncode == launch.TIMEOUT_CODE
    assert out.stdout.count("up") == 4         # two attempts of two workers
    assert time.monotonic() - start < 60
    # Said when it happens, naming the workers that ran on.
    assert out.stderr.count("worker(s) 0, 1 still running after 2 s; stopped them") == 2


def test_the_package_loads_tensorflow_only_when_used():
    """The launcher starts at once: importing tf_gradsync (which `python -m
    tf_gradsync.launch` does) does not import TensorFlow; each public name resolves
    to its module's object when first used."""
    code = textwrap.dedent("""
        import sys
        import tf_gradsync as gs
        assert "tensorflow" not in sys.modules
        assert sorted(gs.__all__) == sorted(gs._EXPORTS)
        import tf_gradsync.cross_device_ops as cdo
        assert gs.CompressedAllReduce is cdo.CompressedAllReduce
        for name in gs.__all__:
            assert getattr(gs, name) is not None, name
        assert gs.pipeline.__name__ == "tf_gradsync.pipeline"   # other submodules too
        try:
            gs.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("no error")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
