"""Issue 47, item 6: one line from every command, ``serve`` and the benchmarks through the same
handler (:func:`moe_rl.argparsing.run_main`), file errors naming the file.

Each case used to end in a traceback (or, for a signal, in no line at all).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from moe_rl.dist import free_port
from tests.badinput.test_outputs_checkpoints import recipe

server_case = pytest.mark.bad_input("server")


@pytest.fixture
def hf(tmp_path, cli) -> Path:
    """A tiny exported HF checkpoint folder."""
    assert cli("export", recipe(tmp_path), tmp_path / "hf", "--random-init", "--dtype", "float32").code == 0
    return tmp_path / "hf"


@pytest.fixture
def never_serves(monkeypatch):
    """Serving is a failure here: each case is refused before the server would listen."""
    import moe_rl.serve.http as http

    def serve(*a, **k):
        raise AssertionError("the server started")

    monkeypatch.setattr(http, "serve", serve)


@server_case
def test_serve_of_a_truncated_safetensors_file_is_one_line_naming_it(cli, hf, never_serves):
    shard = next(hf.glob("*.safetensors"))
    os.truncate(shard, 3000)
    cli("serve", "--model-path", hf, "--port", "0").one_line(
        rf"data error: {shard}: not a readable safetensors file \(SafetensorError: .*\): it was cut short"
    )


@server_case
def test_serve_of_a_broken_config_json_is_one_line_naming_it(cli, hf, never_serves):
    (hf / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": ')
    cli("serve", "--model-path", hf, "--port", "0").one_line(
        rf"configuration error: --model-path {hf}: config\.json is unreadable"
    )


@server_case
def test_serve_with_an_unknown_log_level_is_a_usage_line(cli, never_serves):
    cli("serve", "--log-level", "loud").one_line(r"usage error: .*--log-level: invalid choice: 'LOUD'")


@server_case
def test_update_weights_from_disk_of_a_truncated_file_is_400_naming_it(hf):
    """It was a 500 (SafetensorError)."""
    from moe_rl.serve.app import SGLangProtocolApp
    from tests.unit.test_serve_bounds import CountingEngine

    shard = next(hf.glob("*.safetensors"))
    os.truncate(shard, 3000)
    status, out = SGLangProtocolApp(CountingEngine()).handle(
        "POST", "/update_weights_from_disk", {"model_path": str(hf)}
    )
    assert status == 400 and str(shard) in out["message"] and "not a readable safetensors" in out["message"]


@server_case
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_serve_stopped_by_a_signal_shuts_down_with_one_line(cli, tmp_path, signum):
    """``moe-rl serve`` in this process's main thread; the signal once ``/health`` answers. SIGHUP
    (a closed terminal) used to end it with no line; SIGTERM ended it with exit 0 and no line."""
    port = free_port()

    def stop_when_up():
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    os.kill(os.getpid(), signum)
                    return
            except httpx.HTTPError:
                time.sleep(0.1)

    threading.Thread(target=stop_when_up, daemon=True).start()
    name = signal.Signals(signum).name
    cli("serve", "--model-path", recipe(tmp_path), "--port", str(port)).one_line(
        rf"stopped: {name} received: moe-rl serve shut down", code=128 + signum
    )


@pytest.mark.bad_input("cli")
def test_a_benchmark_reading_a_half_written_json_is_one_line_naming_it(tmp_path, capsys):
    """What the benchmarks, studies and tools read back (``moe_rl.files.read_json``: collapse's
    ``--replot``, serve_throughput's ``--before``, the index) through their handler (``run_main``)
    when the file was cut short: a JSONDecodeError traceback, no file named. (The studies
    themselves are not imported here: nothing but a study imports one.)"""
    from moe_rl.argparsing import run_main
    from moe_rl.files import read_json

    cut = tmp_path / "collapse.json"
    cut.write_text('{"runs": {"GRPO": [')
    assert run_main(lambda: read_json(cut)["runs"], verbose=False) == 2
    err = capsys.readouterr().err
    assert f"moe-rl: data error: {cut}:1:" in err and "not valid JSON" in err and "Traceback" not in err
