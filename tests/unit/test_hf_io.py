"""moe_rl.hf_io: the safetensors shard writer + index, the reader, the atomic directory replace."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_rl.hf_io import (
    INDEX,
    ShardWriter,
    atomic_dir,
    read_tensors,
    scan_headers,
    shard_files,
    write_tensors,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 6, generator=g)
    return {
        "a.weight": torch.randn(4, 4, generator=g),  # 64 B
        "b.weight": base[:, :3],  # a non-contiguous view of a larger storage
        "c.weight": torch.randn(10, generator=g).bfloat16(),
        "d.bias": torch.arange(5, dtype=torch.int64),
        "e.weight": torch.randn(3, 3, generator=g),
    }


def test_writer_shards_index_and_round_trip(tmp_path):
    named = _tensors()
    written = write_tensors(named.items(), tmp_path, max_shard_bytes=100)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    n = len(files)
    assert n == written.num_shards > 1 and written.num_tensors == len(named)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    text = (tmp_path / INDEX).read_text()
    index = json.loads(text)
    # transformers' save_pretrained layout: sorted keys, indent 2, trailing newline
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    sizes = {k: t.numel() * t.element_size() for k, t in named.items()}
    assert index["metadata"] == {
        "total_parameters": sum(t.numel() for t in named.values()),
        "total_size": sum(sizes.values()),
    }
    assert set(index["weight_map"]) == set(named) and set(index["weight_map"].values()) == set(files)
    back = read_tensors(tmp_path)
    assert set(back) == set(named)
    for k, t in named.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)
    assert {k: v[1] for k, v in scan_headers(tmp_path).items()} == {
        k: tuple(t.shape) for k, t in named.items()
    }
    # no shard over the limit unless one tensor alone is larger
    for f in files:
        names = [k for k, v in index["weight_map"].items() if v == f]
        assert len(names) == 1 or sum(sizes[k] for k in names) <= 100


def test_writer_matches_huggingface_hub_split(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    named = {k: v.contiguous() for k, v in _tensors().items()}
    write_tensors(named.items(), tmp_path, max_shard_bytes=100)
    ours = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    split = hub.split_torch_state_dict_into_shards(
        named, filename_pattern="model{suffix}.safetensors", max_shard_size=100
    )
    assert ours == split.tensor_to_filename


def test_writer_refuses_repeats_and_nothing(tmp_path):
    w = ShardWriter(tmp_path)
    w.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="'x' given twice"):
        w.add("x", torch.ones(2))
    with pytest.raises(ValueError, match="no tensors"):
        ShardWriter(tmp_path / "empty").finish()


def test_reader_without_index_and_repeated_names(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"v": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    assert shard_files(tmp_path) == ["one.safetensors", "two.safetensors"]
    assert set(read_tensors(tmp_path)) == {"v", "w"}
    save_file({"w": torch.zeros(2)}, str(tmp_path / "three.safetensors"))
    with pytest.raises(ValueError, match="'w' appears"):
        read_tensors(tmp_path)
    with pytest.raises(ValueError, match="'w' appears in both"):
        scan_headers(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json"):
        shard_files(tmp_path / "nothing")


def test_atomic_dir_replaces_on_success_and_keeps_the_old_on_failure(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_dir(out) as tmp:
        (tmp / "f.txt").write_text("v1")
    assert (out / "f.txt").read_text() == "v1"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(out) as tmp:
            (tmp / "f.txt").write_text("half-written")
            raise RuntimeError("boom")
    assert (out / "f.txt").read_text() == "v1"
    with atomic_dir(out) as tmp:
        (tmp / "g.txt").write_text("v2")
    assert sorted(p.name for p in out.iterdir()) == ["g.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or trash left behind


@pytest.mark.integration
def test_a_killed_writers_staging_is_removed_by_the_next_and_a_live_ones_kept(tmp_path):
    """``kill -9`` inside :func:`atomic_dir` leaves its hidden staging directory beside the target
    (about 60 GB for a 30B export); the next call into that target removes it, but never the
    staging of a writer that is still running."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "hf"
    code = (
        "import sys, time\n"
        "from moe_rl.hf_io import atomic_dir\n"
        "with atomic_dir(sys.argv[1]) as t:\n"
        "    (t / 'shard').write_bytes(b'x' * 1000)\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def writer():
        p = subprocess.Popen(
            [sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert p.stdout.readline().strip() == "writing"
        return p

    killed, live = writer(), writer()
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    staged = sorted(p.name for p in tmp_path.glob(".hf.tmp-*"))
    assert len(staged) == 2
    try:
        with atomic_dir(out) as t:
            (t / "f.txt").write_text("mine")
        left = sorted(p.name for p in tmp_path.glob(".hf.tmp-*"))
        assert len(left) == 1 and (tmp_path / left[0] / "shard").exists()  # the live writer's, kept
        assert sorted(p.name for p in out.iterdir()) == ["f.txt"]  # no owner file in the result
    finally:
        live.kill()
        live.wait()
