"""megatron-core's distributed optimizer across layouts (dist tier).

DP=2 with the distributed optimizer (fp32 main weights and Adam moments sharded over the two
ranks) trains to the same parameters as one process, and a checkpoint's optimizer state
reshards: saved at DP=2 (distributed) it resumes in one process (non-distributed), saved in one
process it resumes at EP=2; either way the next step lands where an uninterrupted run does.
"""

import pytest
import torch

from tests.dist.test_parallel_equivalence import run

pytestmark = pytest.mark.dist


def check_params(ref, results, atol):
    """Every parameter element of ``results`` (by global offset) against the one-process ``ref``."""
    seen, worst = set(), 0.0
    for res in results:
        for key, (offset, p) in res["params"].items():
            want = ref["params"][key][1]
            idx = tuple(slice(o, o + n) for o, n in zip(offset, p.shape))
            torch.testing.assert_close(p, want[idx], atol=atol, rtol=0, msg=key)
            worst = max(worst, float((p - want[idx]).abs().max()))
            seen.add(key)
    assert seen == set(ref["params"]), set(ref["params"]) ^ seen
    return worst


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process: 3 steps straight, and 2 steps saved with their optimizer state."""
    d = tmp_path_factory.mktemp("single")
    run(["--steps", "3", "--distributed", "auto", "--out", str(d / "three")])
    run(["--steps", "2", "--distributed", "auto", "--save-after", str(d / "ckpt2"), "--out", str(d / "two")])
    ref = torch.load(d / "three" / "rank0.pt", weights_only=False)
    assert not ref["distributed"]  # auto: off in a world of one
    return d, ref


def load_ranks(path, n):
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(n)]


def test_dp2_distributed_optimizer_equals_one_process(single, tmp_path):
    d, ref = single
    run(["--dp", "2", "--steps", "3", "--distributed", "auto", "--out", str(tmp_path / "dp2")], nproc=2)
    results = load_ranks(tmp_path / "dp2", 2)
    assert all(r["distributed"] for r in results)  # auto: on where DP > 1
    for res in results:  # the global gradient norm (clipped at 0.5) agrees on every step
        for got, want in zip(res["stats"], ref["stats"]):
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
            assert got["skipped"] == 0.0
    check_params(ref, results, atol=1e-6)


def test_optimizer_state_reshards_dp2_to_one_process(single, tmp_path):
    d, ref = single
    ckpt = tmp_path / "dp2ckpt"
    run(
        [
            "--dp",
            "2",
            "--steps",
            "2",
            "--distributed",
            "auto",
            "--save-after",
            str(ckpt),
            "--out",
            str(tmp_path / "dp2"),
        ],
        nproc=2,
    )
    run(["--load", str(ckpt), "--steps", "1", "--distributed", "auto", "--out", str(tmp_path / "one")])
    (res,) = load_ranks(tmp_path / "one", 1)
    assert not res["distributed"]  # distributed state (DP=2) into the plain optimizer
    check_params(ref, [res], atol=1e-6)


def test_optimizer_state_reshards_one_process_to_ep2(single, tmp_path):
    d, ref = single
    run(
        [
            "--ep",
            "2",
            "--dp",
            "2",
            "--load",
            str(d / "ckpt2"),
            "--steps",
            "1",
            "--distributed",
            "auto",
            "--out",
            str(tmp_path / "ep2"),
        ],
        nproc=2,
    )
    results = load_ranks(tmp_path / "ep2", 2)
    assert all(r["distributed"] for r in results)
    check_params(ref, results, atol=1e-6)
