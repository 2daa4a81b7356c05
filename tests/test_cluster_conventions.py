"""The cluster launch files in examples/ (a Kubeflow TFJob and a Slurm batch script): each
is parsed, the TF_CONFIG or cluster it would give each worker is derived the way the
Kubeflow training operator and TensorFlow's SlurmClusterResolver derive it, and its
entry point runs locally with that configuration (addresses mapped to 127.0.0.1)."""

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import yaml

from tf_gradsync.launch import free_ports
from tf_gradsync.strategy import check_tf_config
from _multiworker import ROOT, assert_same_weights, results

TFJOB = os.path.join(ROOT, "examples", "k8s", "tfjob.yaml")
SBATCH = os.path.join(ROOT, "examples", "slurm", "digits.sbatch")


# ------------------------------------------------------------ Kubeflow TFJob
def tfjob_tf_configs(manifest: dict, namespace: str = "default") -> list[dict]:
    """The TF_CONFIG the training operator gives each replica of a TFJob: one address per
    replica, `<job>-<type>-<index>.<namespace>.svc:<tfjob-port>`, in type order."""
    name = manifest["metadata"]["name"]
    cluster, tasks = {}, []
    for rtype, spec in manifest["spec"]["tfReplicaSpecs"].items():
        container = spec["template"]["spec"]["containers"][0]
        port = next((p["containerPort"] for p in container.get("ports", [])
                     if p.get("name") == "tfjob-port"), 2222)
        kind = rtype.lower()
        cluster[kind] = [f"{name}-{kind}-{i}.{namespace}.svc:{port}"
                         for i in range(spec.get("replicas", 1))]
        tasks += [(kind, i) for i in range(spec.get("replicas", 1))]
    return [{"cluster": cluster, "task": {"type": t, "index": i}} for t, i in tasks]


def test_tfjob_manifest_gives_a_valid_tf_config_per_worker():
    with open(TFJOB, encoding="utf-8") as f:
        manifest = yaml.safe_load(f)
    assert manifest["kind"] == "TFJob" and manifest["apiVersion"] == "kubeflow.org/v1"
    configs = tfjob_tf_configs(manifest)
    assert configs == [
        {"cluster": {"worker": ["gradsync-digits-worker-0.default.svc:2222",
                                "gradsync-digits-worker-1.default.svc:2222"]},
         "task": {"type": "worker", "index": i}} for i in range(2)]
    for cfg in configs:
        assert check_tf_config(json.dumps(cfg)) == cfg


def _run_workers(commands, envs, timeout=420):
    """Starts one process per command; waits for all (bounded), stops the rest on a failure."""
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for cmd, env in zip(commands, envs)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    for key in ("TF_CONFIG",) + tuple(k for k in env if k.startswith("SLURM_")):
        env.pop(key, None)
    env.update(extra)
    return env


@pytest.mark.slow
def test_tfjob_entry_point_runs_with_the_operators_tf_config(tmp_path):
    with open(TFJOB, encoding="utf-8") as f:
        manifest = yaml.safe_load(f)
    container = manifest["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    configs = tfjob_tf_configs(manifest)
    # The pods' DNS names do not resolve here: the same cluster, on local ports.
    local = dict(zip(configs[0]["cluster"]["worker"],
                     (f"127.0.0.1:{p}" for p in free_ports(len(configs)))))
    configs = [dict(c, cluster={"worker": [local[a] for a in c["cluster"]["worker"]]})
               for c in configs]
    command = [sys.executable if c == "python" else c for c in container["command"]]
    command += container["args"] + ["--epochs=2", f"--out={tmp_path}"]
    _run_workers([command] * len(configs), [_env(TF_CONFIG=json.dumps(c)) for c in configs])
    weights, res = results(tmp_path, len(configs))
    assert_same_weights(weights)
    assert res[0]["stats"]["compression_ratio"] == pytest.approx(2.0)   # --compression=fp16


# ------------------------------------------------------------ Slurm
def sbatch_job(path: str) -> tuple[dict, list[str]]:
    """The `#SBATCH` options of a batch script and the argv that `srun` runs."""
    options, lines = {}, []
    with open(path, encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)=(\S+)", line)
        if m:
            options[m.group(1)] = m.group(2)
        elif line.strip().startswith("srun "):
            lines.append(line)
    assert len(lines) == 1, lines
    return options, shlex.split(lines[0])[1:]


def _fake_scontrol(directory, hosts) -> str:
    """An `scontrol show hostnames` that expands any node list to `hosts`."""
    path = os.path.join(directory, "scontrol")
    with open(path, "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in hosts))
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return directory


def _slurm_env(rank, tasks, nodelist, tasks_per_node, path_dir):
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
            "PATH": path_dir + os.pathsep + os.environ["PATH"]}


def test_sbatch_script_gives_each_task_its_worker(tmp_path, monkeypatch):
    options, argv = sbatch_job(SBATCH)
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert argv[:2] == ["python", "examples/multiworker_digits.py"] and "--cluster=slurm" in argv
    port = int(next(a for a in argv if a.startswith("--port_base=")).split("=")[1])
    hosts = [f"node{i + 1}" for i in range(nodes)]
    scontrol = _fake_scontrol(str(tmp_path), hosts)
    for rank in range(nodes * per_node):
        for key, value in _slurm_env(rank, nodes * per_node, f"node[1-{nodes}]",
                                     f"{per_node}(x{nodes})", scontrol).items():
            monkeypatch.setenv(key, value)
        # As the example builds it on CPU-only nodes.
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port, gpus_per_node=1 << 16, gpus_per_task=1, auto_set_gpu=False)
        assert resolver.cluster_spec().as_dict() == {
            "worker": [f"{h}:{port + i}" for h in hosts for i in range(per_node)]}
        assert (resolver.task_type, resolver.task_id) == ("worker", rank)


@pytest.mark.slow
def test_sbatch_entry_point_runs_under_slurm_variables(tmp_path):
    options, argv = sbatch_job(SBATCH)
    tasks = int(options["nodes"]) * int(options["ntasks-per-node"])
    # One local node running every task, on free ports from port_base.
    base = free_ports(1)[0]
    while any(p != base + i for i, p in enumerate(range(base, base + tasks))):
        base = free_ports(1)[0]
    argv = [a for a in argv if not a.startswith(("--port_base=", "--epochs="))]
    command = [sys.executable, *argv[1:], f"--port_base={base}", "--epochs=2",
               f"--out={tmp_path}"]
    scontrol = _fake_scontrol(str(tmp_path), ["127.0.0.1"])
    _run_workers([command] * tasks,
                 [_env(**_slurm_env(r, tasks, "127.0.0.1", str(tasks), scontrol))
                  for r in range(tasks)])
    weights, res = results(tmp_path, tasks)
    assert_same_weights(weights)
    assert all(np.isfinite(r["accuracy"]) and r["accuracy"] > 0.5 for r in res)
