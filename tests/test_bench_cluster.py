"""The cluster bench: namespaces, links and shaping, kernel byte counters, flag checks,
clean-up, and a tiny end-to-end run checked against the byte arithmetic."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tf_gradsync import launch
from tf_gradsync.bench import __main__ as bench_main  # noqa: F401  (defines --compressors)
from tf_gradsync.bench import cluster, netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None
                                or shutil.which("tc") is None,
                                reason="network namespaces need root and iproute2")


def names() -> set[str]:
    """Every namespace and link name on the host that the bench could have made."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = re.findall(r"^\d+:\s+([^:@\s]+)",
                       subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout,
                       re.M)
    return {n for n in ns + links if n.startswith(netns.PREFIX)}


def in_ns(net, i, *cmd, **kw):
    return subprocess.run([*net.exec_prefix(i), *cmd], capture_output=True, text=True,
                          timeout=60, **kw)


def tx_bytes(net, i) -> int:
    return int(in_ns(net, i, "cat", f"/sys/class/net/{net.interface}/statistics/tx_bytes").stdout)


def run_suite(argv):
    """cluster.run() with these flags (then back to the defaults)."""
    flags = cluster.FLAGS
    flags.unparse_flags()
    flags(["bench", *argv])
    try:
        return cluster.run()
    finally:
        flags.unparse_flags()


@pytest.mark.parametrize("text,bps", [("100mbit", 10**8), ("1gbit", 10**9), ("10Gbit", 10**10),
                                      ("2.5gbit", 25 * 10**8), ("64kbit", 64_000)])
def test_parse_rate(text, bps):
    assert netns.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "10", "0mbit", "-1gbit", "1gbyte", "1 g bit", "1000gbit"])
def test_bad_rate_names_the_value(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        netns.parse_rate(text)


def test_suite_rejects_a_bad_rate_naming_it():
    with pytest.raises(SystemExit) as e:
        run_suite(["--rate=1gbit,fast"])
    assert "--rate" in str(e.value.code) and "'fast'" in str(e.value.code)
    assert "mbit" in str(e.value.code)   # says what is accepted


def test_suite_without_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as e:
        run_suite(["--rate=1gbit"])
    assert "need root" in str(e.value.code)


@needs_root
def test_delay_fails_clearly_without_netem():
    if netns.netem_available():
        pytest.skip("this kernel has netem")
    before = names()
    with pytest.raises(SystemExit) as e:
        run_suite(["--delay=5ms"])
    assert "netem" in str(e.value.code) and "'5ms'" in str(e.value.code)
    with pytest.raises(RuntimeError, match="netem"):
        netns.Network(2, "1gbit", delay="5ms").setup()
    with pytest.raises(SystemExit, match="bad delay 'soon'"):
        run_suite(["--delay=soon"])
    assert names() == before


@needs_root
def test_setup_and_teardown_leave_nothing_behind():
    before = names()
    with netns.Network(3, "1gbit") as net:
        made = names() - before
        assert set(net.namespaces) | set(net.bridge_ports) | {net.bridge} == made
        for i, ns in enumerate(net.namespaces):
            addr = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr", "show", net.interface],
                                  capture_output=True, text=True).stdout
            assert f"inet {net.addresses[i]}/24" in addr
        # A process left running in a namespace is killed with it.
        sleeper = subprocess.Popen([*net.exec_prefix(1), "sleep", "600"])
        time.sleep(0.2)
    assert sleeper.wait(timeout=10) != 0
    assert names() == before


@needs_root
@pytest.mark.parametrize("rate", ["100mbit", "2500mbit"])
def test_both_ends_of_every_link_are_shaped_to_the_rate(rate):
    with netns.Network(2, rate) as net:
        for i in range(2):
            for ns, dev in ((net.namespaces[i], net.interface), (None, net.bridge_ports[i])):
                (q,) = netns.qdiscs(ns, dev)
                assert (q["kind"], q["rate_bps"]) == ("tbf", netns.parse_rate(rate))
                # tc keeps the bucket to its clock's resolution.
                assert q["burst"] == pytest.approx(netns.tbf_burst(q["rate_bps"]), rel=1e-3)


def test_the_token_bucket_holds_4_ms_at_the_rate_and_at_least_16_kib():
    assert netns.tbf_burst(10 * 10**9) == 5_000_000
    assert netns.tbf_burst(10**9) == 500_000
    assert netns.tbf_burst(100 * 10**6) == 50_000
    assert netns.tbf_burst(10**6) == 16 * 1024


_TCP = """
import socket, sys
role, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "server":
    s = socket.socket(); s.bind((addr, 5555)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); got = 0
    while True:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.sendall(b"k"); print(got)
else:
    c = socket.create_connection((addr, 5555), timeout=30)
    c.sendall(b"x" * n); c.shutdown(socket.SHUT_WR); c.recv(1)
"""


@needs_root
def test_tcp_transfer_between_namespaces_shows_in_the_tx_counter(tmp_path):
    script = tmp_path / "tcp.py"
    script.write_text(_TCP)
    sent = 20_000_000
    with netns.Network(2, "1gbit") as net:
        server = subprocess.Popen([*net.exec_prefix(1), sys.executable, str(script), "server",
                                   net.addresses[1], "0"], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        start = tx_bytes(net, 0)
        client = in_ns(net, 0, sys.executable, str(script), "client", net.addresses[1], str(sent))
        assert client.returncode == 0, client.stderr
        assert int(server.communicate(timeout=30)[0]) == sent
        wire = tx_bytes(net, 0) - start
    # Headers (TCP/IP/Ethernet, per GSO segment) only add to the payload.
    assert sent <= wire <= 1.15 * sent


@needs_root
def test_stale_leftovers_of_a_dead_run_are_removed_and_live_ones_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = f"{netns.PREFIX}{dead.pid}z"
    subprocess.run(["ip", "netns", "add", f"{tag}n0"], check=True)
    subprocess.run(["ip", "link", "add", f"{tag}br", "type", "bridge"], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{tag}n0", "sleep", "600"])
    time.sleep(0.2)
    with netns.Network(2, "1gbit") as net:
        removed = netns.cleanup_stale()
        assert {f"{tag}n0", f"{tag}br"} <= set(removed)
        left = names()
        assert not any(n.startswith(tag) for n in left)
        assert set(net.namespaces) <= left and net.bridge in left
    assert sleeper.wait(timeout=10) != 0


@needs_root
def test_a_worker_that_dies_stops_the_others_and_a_hung_one_times_out(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import json, os, sys, time\n"
                      "r = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                      "sys.exit(3) if r == 1 and len(sys.argv) > 1 else time.sleep(600)\n")
    with netns.Network(2, "1gbit") as net:
        prefixes = [net.exec_prefix(i) for i in range(2)]
        configs = launch.tf_configs([f"{a}:1" for a in net.addresses])
        start = time.monotonic()
        job = launch.Job([str(script), "die"], configs, 1, prefixes=prefixes)
        assert job.wait(timeout=60) == 3
        job = launch.Job([str(script)], configs, 1, prefixes=prefixes)
        with pytest.raises(TimeoutError):
            job.wait(timeout=1)
        assert all(p.poll() is not None for p in job.procs)
        assert time.monotonic() - start < 30


def test_rematch_runs_the_fastest_row_and_autotune_alternately_and_compares_medians():
    rows = [{"mode": "compute-only", "step_s": 0.01}, {"mode": "stock MWMS", "step_s": 1.0},
            {"mode": "fp16", "step_s": 0.30}, {"mode": "topk", "step_s": 0.20},
            {"mode": "autotune: topk", "step_s": 0.25}]
    steps = {"topk": iter([0.22, 0.18, 0.26]), "autotune": iter([0.21, 0.30, 0.19])}
    calls = []

    def job(mode, extra):
        calls.append((mode, list(extra)))
        ranks = [{"median_s": next(steps[mode])}]
        if mode == "autotune":
            ranks[0]["decision"] = {"compressor": "topk"}
        return ranks * 2    # two workers, the same step

    cluster.rematch_jobs(rows, 3, job, ["--candidates=fp16,topk"])
    assert calls == [("topk", []), ("autotune", ["--candidates=fp16,topk"])] * 3
    tuned = rows[-1]
    assert tuned["rematch"] == {"best": "topk", "best_s": [0.22, 0.18, 0.26],
                                "autotune_s": [0.21, 0.30, 0.19],
                                "autotune_picks": ["topk"] * 3}
    assert tuned["vs_best_rematch"] == pytest.approx(0.21 / 0.22)
    assert all("rematch" not in r for r in rows[:-1])


def test_one_core_pins_every_thread_then_gives_the_cores_back():
    from tf_gradsync.bench import multiworker  # pylint: disable=import-outside-toplevel
    allowed = os.sched_getaffinity(0)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        # This thread and one started before (as TensorFlow's pools are).
        threads = (0, other.native_id)
        with multiworker._one_core():  # pylint: disable=protected-access
            assert all(os.sched_getaffinity(t) == {min(allowed)} for t in threads)
        assert all(os.sched_getaffinity(t) == allowed for t in threads)
    finally:
        stop.set()
        other.join()


@needs_root
@pytest.mark.slow
def test_tiny_end_to_end_run(tmp_path):
    before = names()
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "tf_gradsync.bench", "cluster", "--cluster_workers=2",
         "--rate=1gbit", "--params=100000", "--steps=3", "--compressors=fp16,autotune",
         "--rematch=1", f"--json={out}"],
        env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU cores shared by 2 workers" in proc.stderr
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["compute-only", "stock MWMS", "fp16", "autotune: fp16"]
    optional = {"stats_bytes", "wire_vs_stats", "vs_best_rematch"}
    assert all(set(cluster.COLUMNS) - optional <= set(r) for r in rows[1:])
    params = rows[0]["params"]
    assert params == 316 * 316 + 316
    compute, stock, fp16, tuned = rows
    # autotune chose among the other rows' compressors (fp16 alone here), after timing
    # it on the job (once: every bucket size groups this model alike, and its all-reduce
    # is one kind of exchange); it sends what fp16 sends.
    assert [t[:1] for t in tuned["decision"]["trials"]] == [["fp16"]]
    assert tuned["decision"]["measured_step_s"] == min(t[4] for t in tuned["decision"]["trials"])
    assert tuned["decision"]["ops"] == "Float16(prescale=True)"       # lossless: not guarded
    assert tuned["stats_bytes"] == fp16["stats_bytes"] and tuned["exchange"] == "all-reduce"
    assert tuned["vs_best"] == pytest.approx(tuned["step_s"] / fp16["step_s"])
    assert fp16["vs_best"] == 1.0 and tuned["pick"] == ""
    # The rematch: fp16 (the fastest compressor row) and autotune, one more job each.
    rematch = tuned["rematch"]
    assert rematch["best"] == "fp16" and rematch["autotune_picks"] == ["fp16"]
    assert len(rematch["best_s"]) == len(rematch["autotune_s"]) == 1
    assert tuned["vs_best_rematch"] == pytest.approx(
        rematch["autotune_s"][0] / rematch["best_s"][0])
    assert "vs_best_rematch" not in fp16
    rows = rows[:3]
    # Ring arithmetic for 2 workers, 2(N-1)/N = 1: each sends one payload per step.
    assert stock["ring_bound"] == 4 * params
    assert fp16["stats_bytes"] == fp16["ring_bound"] == 2 * params
    # Kernel counters: the payload plus protocol overhead (TCP/IP headers, gRPC framing,
    # the loss all-reduce: a few KiB per step); nothing crosses in compute-only steps.
    overhead = 8192
    for row, expected in ((stock, stock["ring_bound"]), (fp16, fp16["stats_bytes"])):
        assert 0.85 * expected <= row["wire_bytes"] <= 1.15 * expected + overhead
    assert compute["wire_bytes"] < 1024
    # The cost model's prediction of each step, from the same sitting's probe.
    for row in (stock, fp16):
        assert row["predicted_s"] > compute["step_s"]
        assert row["prediction_error"] == pytest.approx(row["predicted_s"] / row["step_s"] - 1)
    assert fp16["pick"] == "*" and stock["pick"] == ""
    # The all-to-all two phases would run, timed by the probes before the rows and by
    # the link's probes after them: 2 workers, one round.
    links = compute["link_probes"]
    assert len(links) == 2 and not any(p["throughput_one_core"] for p in links)
    all_to_all = [p["all_to_all_s"] for p in compute["probes"] + links]
    assert all(s > 0 for s in all_to_all)
    assert stock["link"][2] == pytest.approx(sum(all_to_all) / 4)
    # The JSON keeps what the prediction was made from: predicting again gives it back.
    again = json.loads(out.read_text())
    cluster.predict(again, compute["probes"], compute["specs"], 2, links)
    for row, redone in zip(rows[1:], again[1:]):
        assert redone["predicted_s"] == pytest.approx(row["predicted_s"])
    # Both probing jobs count: a link twice as slow after the rows prices the ring's
    # bytes slower.
    for p in links:
        p["probe_s"] = [2 * s for s in p["probe_s"]]
    cluster.predict(again, compute["probes"], compute["specs"], 2, links)
    assert again[1]["predicted_s"] > stock["predicted_s"]
    assert again[1]["link"][1] < stock["link"][1]
    # Each worker timed the codecs alone, and the runs share the cores: were there one
    # core for the two workers, each worker's codec would take twice as long.
    assert all(p["alone"] for p in compute["probes"])
    again[0]["cores"] = "1/2"
    cluster.predict(again, compute["probes"], compute["specs"], 2, links)
    assert again[2]["codec_s"] == pytest.approx(2 * fp16["codec_s"])
    # The codecs priced are those each worker timed on one core: a rate and a cost per
    # call, both measured (a call's cost is fitted from two lengths' timings, and is 0
    # where a busy machine's noise hides it).
    assert all(p["throughput_one_core"].keys() == p["call_s_one_core"].keys()
               and all(s >= 0 for s in p["call_s_one_core"].values())
               and all(r > 0 for r in p["throughput_one_core"].values())
               for p in compute["probes"])
    for p in compute["probes"]:
        p["throughput_one_core"] = {m: 2 * v for m, v in p["throughput_one_core"].items()}
        p["call_s_one_core"] = {m: v / 2 for m, v in p["call_s_one_core"].items()}
    again[0]["cores"] = "2/2"
    cluster.predict(again, compute["probes"], compute["specs"], 2, links)
    assert again[2]["codec_s"] == pytest.approx(fp16["codec_s"] / 2)
    # Where each step goes: the parts add up to the step; the wire at the link's rate.
    for row in rows:
        parts = row["compute_s"] + row["codec_s"] + row["wire_s"] + row["waiting_s"]
        assert parts == pytest.approx(row["step_s"])
        assert row["wire_s"] == pytest.approx(row["wire_bytes"] / 125e6)
    assert compute["compute_s"] == compute["step_s"] and stock["compute_s"] == compute["step_s"]
    assert stock["codec_s"] == 0 < fp16["codec_s"]
    assert stock["speedup"] == pytest.approx(1.0)
    assert fp16["speedup"] == pytest.approx(stock["step_s"] / fp16["step_s"])
    assert names() == before
