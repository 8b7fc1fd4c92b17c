"""Issue 47, item 6: ``moe-rl compare`` / ``demo`` check every arm's recipe and every service it
attaches to before the SFT start trains.

They found an arm's configuration or a server that is down only after training the start
(minutes), then launched every arm and exited 1 with an empty table.
"""

from __future__ import annotations

import socket

import pytest

from tests.badinput.test_nothing_lost import compare, one_line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.bad_input("override")
def test_an_rl_length_past_the_model_is_refused_before_the_sft_start(tmp_path, parallel_info):
    out = tmp_path / "out"
    code, stdout, err = compare(out, "train.max_new_tokens=40")
    assert code == 2, err
    assert "compare arm GRPO: task arithmetic: the longest prompt" in one_line(err)
    assert "SFT start" not in stdout and not (out / "starts").exists()


@pytest.mark.bad_input("os")
def test_an_attached_server_that_is_down_is_refused_before_the_sft_start(tmp_path, parallel_info):
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    code, stdout, err = compare(out, "rollout.engine=sglang", f"rollout.sglang.url={url}")
    assert code == 2, err
    line = one_line(err)
    assert line.startswith("moe-rl: unavailable: compare arm GRPO: rollout.sglang.url=") and url in line
    assert "SFT start" not in stdout and not (out / "starts").exists()
