"""GPU tier: one trainer RL step on CUDA for every algorithm x routing mode, and resume equality
(skipped without CUDA). The helpers are tools/gpu_check.py's, whose ``rl_step`` section runs
the same code (``make gpu-check``, docs/gpu_check.md)."""

import pytest
import torch

from tools.gpu_check import ALGOS, ROUTINGS, one_rl_step, resume_check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("algo", ALGOS)
def test_one_rl_step_on_cuda(tmp_path, algo, routing):
    res = one_rl_step(tmp_path, algo, routing)
    assert res["device"].startswith("cuda"), res
    assert res["ok"], res


def test_resume_continues_the_run_on_cuda(tmp_path):
    res = resume_check(tmp_path)
    assert res["steps_after_resume"] == [0, 1], res
    assert res["ok"], res
