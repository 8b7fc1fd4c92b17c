"""The launchers: launch/torchrun.sh on two CPU ranks, and launch/slurm.sbatch's multi-node wiring.

The Slurm script is run here outside Slurm with stand-in ``scontrol`` and ``srun`` on PATH: a
three-node job with SGLANG_NODES=1 must start the server step on the last node, wait for its
/health_generate, give the trainer step the first two nodes with c10d rendezvous and the
sglang overrides, and stop the server afterwards. tests/dist/test_slurm.py runs the real thing.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moe_rl.dist import free_port

pytestmark = pytest.mark.dist
ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
ENV.pop("NPROC", None)


def test_torchrun_sh_trains_two_ranks(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run(
        [
            str(ROOT / "launch/torchrun.sh"),
            "recipes/tiny_ep2.yaml",
            "train.sft_steps=3",
            f"train.out_dir={out}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in rows] == [("sft", 0), ("sft", 1), ("sft", 2)]
    logs = list((out / "logs").glob("torchrun-*.log"))
    assert len(logs) == 1
    text = logs[0].read_text()
    assert "2 processes" in text and "[rank0]:" in text and "[rank1]:" in text
    assert "sft step 3/3" in text
    # rank 1: its one start line (and warnings), not a copy of rank 0's progress
    rank1 = [ln for ln in text.splitlines() if ln.startswith("[rank1]:") and " INFO " in ln]
    assert len(rank1) == 1 and "[rank 1] INFO moe_rl.rank: rank 1/2" in rank1[0], rank1
    assert (out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()).is_dir()


@pytest.mark.parametrize(
    "recipe, nproc, needle",
    [
        ("recipes/tiny.yaml", "2", "= 1 processes, but the world has 2"),
        ("recipes/tiny_ep2.yaml", "3", "= 2 processes, but the world has 3"),
    ],
)
def test_torchrun_sh_fails_fast_on_a_layout_that_does_not_match(tmp_path, recipe, nproc, needle):
    out = tmp_path / "run"
    res = subprocess.run(
        [str(ROOT / "launch/torchrun.sh"), recipe, f"train.out_dir={out}"],
        cwd=ROOT,
        env={**ENV, "NPROC": nproc},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "moe-rl: configuration error: parallel layout" in res.stderr and needle in res.stderr
    assert not out.exists()  # nothing started


def test_torchrun_sh_usage():
    res = subprocess.run([str(ROOT / "launch/torchrun.sh")], env=ENV, capture_output=True, text=True)
    assert res.returncode == 2 and "launch/torchrun.sh RECIPE" in res.stderr


# --- slurm.sbatch with stand-in srun / scontrol ------------------------------------------------

FAKE_SRUN = textwrap.dedent('''\
    #!{python}
    """Record argv; a server step serves 200 on 127.0.0.1:<port> until SIGTERM (node-rank 0 only)."""
    import http.server, json, os, signal, sys, time
    argv = sys.argv[1:]
    with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
        f.write(json.dumps(argv) + "\\n")
    if "--port" in argv:
        if os.environ.get("FAKE_SGLANG_FAIL"):
            sys.exit(1)
        port = int(argv[argv.index("--port") + 1])

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        def stop(*_):  # says whether the trainers had ended when the server was stopped
            ended = os.path.exists(os.environ["FAKE_SRUN_LOG"] + ".trainer_term")
            with open(os.environ["FAKE_SRUN_LOG"] + ".stopped", "w") as f:
                f.write("after the trainers" if ended else "while the trainers ran")
            sys.exit(0)

        signal.signal(signal.SIGTERM, stop)
        if "--node-rank" in argv and argv[argv.index("--node-rank") + 1] != "0":
            signal.pause()  # only the first node of a multi-node SGLang server answers HTTP
        http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    elif os.environ.get("FAKE_TRAINER_WAITS"):  # a trainer that stops on SIGTERM like moe-rl train

        def term(*_):  # the stop's checkpoint takes FAKE_TRAINER_SAVE_S seconds
            time.sleep(float(os.environ.get("FAKE_TRAINER_SAVE_S", "0")))
            open(os.environ["FAKE_SRUN_LOG"] + ".trainer_term", "w").close()
            sys.exit(143)

        signal.signal(signal.SIGTERM, term)
        signal.pause()
    ''')


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "%s\\n" $FAKE_NODES\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "srun.jsonl"
    env = {
        **ENV,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_SRUN_LOG": str(log),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_CPUS_ON_NODE": "16",
        "SLURM_GPUS_PER_NODE": "8",
        "FAKE_NODES": "n1 n2 127.0.0.1",
        "SGLANG_STARTUP_TIMEOUT": "60",
    }
    for k in ("NPROC", "GPUS_PER_NODE", "SGLANG_NODES", "MASTER_PORT", "SGLANG_PORT"):
        env.pop(k, None)

    def run(args, send_term=False, term_after_steps=1, **extra):
        proc = subprocess.Popen(
            ["bash", str(ROOT / "launch/slurm.sbatch"), *args],
            cwd=ROOT,
            env={**env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if send_term:  # once the trainer step started (the last srun), as Slurm does before the time limit
            deadline = time.time() + 120
            while time.time() < deadline and not (
                log.exists() and len(log.read_text().splitlines()) >= term_after_steps
            ):
                time.sleep(0.1)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        return res, calls, Path(str(log) + ".stopped").exists()

    return run


def _opt(argv, name):
    return argv[argv.index(name) + 1]


def test_sbatch_sglang_node_and_two_trainer_nodes(fake_slurm, tmp_path):
    port = free_port()
    res, calls, stopped = fake_slurm(
        [
            "recipes/cluster/qwen3_30b_a3b_gspo.yaml",
            f"train.out_dir={tmp_path / 'run'}",
            "algo.routing=r3",
            "--resume",
        ],
        SGLANG_NODES="1",
        SGLANG_PORT=str(port),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(calls) == 2
    sg, tr = calls
    # SGLang: one step on the last node, bound to its address, with the recipe's server options
    assert "--nodelist=127.0.0.1" in sg and "--nodes=1" in sg and "--gpus-per-node=8" in sg
    assert sg[sg.index("-m") + 1] == "sglang.launch_server"
    assert (_opt(sg, "--host"), _opt(sg, "--port"), _opt(sg, "--tp-size"), _opt(sg, "--ep-size")) == (
        "127.0.0.1",
        str(port),
        "8",
        "8",
    )
    assert _opt(sg, "--model-path") == "/models/Qwen3-30B-A3B-Base" and _opt(sg, "--dtype") == "bfloat16"
    assert "--enable-return-routed-experts" in sg and "--skip-tokenizer-init" in sg
    assert "--nnodes" not in sg  # one server node
    # trainers: the other two nodes, one torchrun each, c10d rendezvous on the first
    assert "--nodes=2" in tr and "--nodelist=n1,n2" in tr and "--cpus-per-task=16" in tr
    assert "--ntasks-per-node=1" in tr and "--gpus-per-node=8" in tr
    assert tr[tr.index("torch.distributed.run") - 1] == "-m"
    assert {
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=n1:24242",
        "--rdzv-id=4242",
    } <= set(tr)
    cli = tr[tr.index("moe_rl.cli") :]
    assert cli[1:3] == ["train", "recipes/cluster/qwen3_30b_a3b_gspo.yaml"]
    assert cli[-3:] == ["rollout.engine=sglang", f"rollout.sglang.url=http://127.0.0.1:{port}", "--resume"]
    assert stopped  # the server got SIGTERM when the trainer ended
    assert "SGLang healthy" in res.stderr


def test_sbatch_routes_off_and_multi_node_server(fake_slurm, tmp_path):
    port = free_port()
    res, calls, _ = fake_slurm(
        [
            "recipes/cluster/qwen3_30b_a3b_gspo.yaml",
            f"train.out_dir={tmp_path / 'run'}",
            "parallel.data_parallel=4",
            "parallel.expert_parallel=8",
            "rollout.sglang.tp=16",
        ],
        SGLANG_NODES="2",
        SGLANG_PORT=str(port),
        FAKE_NODES="n1 127.0.0.1 n3",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    servers = sorted((c for c in calls if "--port" in c), key=lambda c: _opt(c, "--node-rank"))
    (tr,) = [c for c in calls if "torch.distributed.run" in c]
    sg0, sg1 = servers  # started in the background: any order
    assert "--enable-return-routed-experts" not in sg0  # GSPO: routes off
    assert (_opt(sg0, "--node-rank"), _opt(sg1, "--node-rank"), _opt(sg0, "--nnodes")) == ("0", "1", "2")
    assert _opt(sg0, "--dist-init-addr") == _opt(sg1, "--dist-init-addr") == "127.0.0.1:50000"
    assert _opt(sg0, "--tp-size") == "16" and "--nodelist=n3" in sg1
    assert "--nodes=1" in tr and "--nodelist=n1" in tr and "--nnodes=1" in tr


@pytest.mark.parametrize(
    "args, extra, needle",
    [
        (["recipes/cluster/qwen3_30b_a3b_gspo.yaml"], {"SGLANG_NODES": "3"}, "leaves no trainer node"),
        (["recipes/cluster/qwen3_30b_a3b_gspo.yaml"], {}, "= 16 processes, but the world has 24"),
        (["recipes/tiny_ep2.yaml"], {"GPUS_PER_NODE": "0", "FAKE_NODES": "localhost"}, "needs NPROC"),
        (["--nproc", "3", "recipes/tiny_ep2.yaml"], {"FAKE_NODES": "localhost"}, "but the world has 3"),
    ],
)
def test_sbatch_refuses_before_starting_anything(fake_slurm, args, extra, needle):
    res, calls, _ = fake_slurm(args, **extra)
    assert res.returncode == 2 and needle in res.stderr
    assert calls == []


def test_sbatch_reports_a_server_that_dies(fake_slurm, tmp_path):
    res, calls, _ = fake_slurm(
        ["recipes/cluster/qwen3_30b_a3b_gspo.yaml", f"train.out_dir={tmp_path / 'r'}"],
        SGLANG_NODES="1",
        SGLANG_PORT=str(free_port()),
        FAKE_SGLANG_FAIL="1",
    )
    assert res.returncode != 0 and "exited before becoming healthy" in res.stderr
    assert len(calls) == 1  # the trainer never started


def test_sbatch_forwards_sigterm_to_the_trainers(fake_slurm, tmp_path):
    """Slurm's pre-time-limit SIGTERM (#SBATCH --signal=B:TERM@120) goes to the batch script; it
    forwards it to the trainers' srun, waits for them, and exits with their status."""
    assert "#SBATCH --signal=B:TERM@" in (ROOT / "launch/slurm.sbatch").read_text()
    res = fake_slurm(
        ["--nproc", "2", "recipes/tiny_ep2.yaml", f"train.out_dir={tmp_path / 'run'}"],
        FAKE_NODES="localhost",
        GPUS_PER_NODE="0",
        FAKE_TRAINER_WAITS="1",
        send_term=True,
    )
    result, calls, _ = res
    assert result.returncode == 143, result.stderr[-3000:]
    assert len(calls) == 1 and (tmp_path / "srun.jsonl.trainer_term").exists()
    assert "the trainers checkpoint after their current step" in result.stderr


def test_sbatch_sigterm_leaves_the_sglang_server_serving_until_the_trainers_end(fake_slurm, tmp_path):
    """docs/safety.md, Signals: the batch script forwards Slurm's SIGTERM to the trainers alone; the
    SGLang server step keeps serving while they write their stop checkpoint (here 1 s) and is
    stopped only after they have exited. Planted bug killed: the TERM trap signalling the servers
    too (the trainers' last step then loses its engine)."""
    res, calls, stopped = fake_slurm(
        ["recipes/cluster/qwen3_30b_a3b_gspo.yaml", f"train.out_dir={tmp_path / 'run'}"],
        send_term=True,
        term_after_steps=2,  # the server step, then the trainer step
        SGLANG_NODES="1",
        SGLANG_PORT=str(free_port()),
        FAKE_TRAINER_WAITS="1",
        FAKE_TRAINER_SAVE_S="1",
    )
    assert res.returncode == 143, res.stderr[-3000:]
    assert len(calls) == 2 and (tmp_path / "srun.jsonl.trainer_term").exists()
    assert stopped and (tmp_path / "srun.jsonl.stopped").read_text() == "after the trainers"
