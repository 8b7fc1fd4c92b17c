"""HF Qwen3-MoE import/export against transformers' own implementation (world 1).

A tiny random ``Qwen3MoeForCausalLM`` (built in code, every weight and norm randomised so that
a wrong layout cannot pass) is saved with ``save_pretrained``, imported into the megatron-core
policy and compared logit by logit; export -> import and export -> transformers round trips,
fused-expert checkpoints, refusals of unsupported configs and broken checkpoints, and the
HFStateSource / WeightSink side.
"""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from moe_rl.config import ConfigError, ParallelConfig  # noqa: E402
from moe_rl.megatron.hf import (  # noqa: E402
    PolicyHFSource,
    config_from_hf,
    export_hf,
    hf_config,
    import_hf,
    model_config_from_path,
)
from moe_rl.megatron.hf_mapping import mismatches  # noqa: E402

TOL = 1e-4  # measured max |gap| on these models: about 1.2e-6 (fp32)


def tiny_hf(path, *, norm_topk_prob=True, tie=False, seed=0):
    """Save a random tiny Qwen3-MoE to ``path``; return the (eval) transformers model."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms: not all ones, so a swapped norm shows
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def policy_for(path, parallel_info, **overrides):
    """A randomly initialised policy shaped like the checkpoint at ``path`` (not loaded)."""
    from moe_rl.megatron.policy import build_policy

    cfg = model_config_from_path(path, **{"hf_path": None, **overrides})
    return build_policy(cfg, ParallelConfig(), parallel_info).eval()


def tokens(seed=0):
    return torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(seed))


def gap(policy, model, toks):
    with torch.no_grad():
        return (policy.logits(toks) - model(toks).logits).abs().max().item()


def params(policy):
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    return tiny_hf(path), path


@pytest.mark.parametrize("norm_topk_prob,tie", [(True, False), (False, False), (True, True)])
def test_import_matches_transformers(parallel_info, tmp_path, norm_topk_prob, tie):
    model = tiny_hf(tmp_path / "ck", norm_topk_prob=norm_topk_prob, tie=tie)
    policy = policy_for(tmp_path / "ck", parallel_info)
    assert policy.cfg.moe_norm_topk_prob is norm_topk_prob and policy.cfg.tie_embeddings is tie
    toks = tokens()
    assert gap(policy, model, toks) > 0.1  # random init: the comparison can fail
    import_hf(policy, tmp_path / "ck")
    assert gap(policy, model, toks) < TOL
    from moe_rl.megatron.policy import build_policy

    loaded = build_policy(model_config_from_path(tmp_path / "ck"), ParallelConfig(), parallel_info).eval()
    assert gap(loaded, model, toks) < TOL  # model.hf_path loads the checkpoint at build time


def test_export_then_import_is_exact(hf_ckpt, parallel_info, tmp_path):
    _, path = hf_ckpt
    policy = policy_for(path, parallel_info)
    import_hf(policy, path)
    out = export_hf(policy, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert not list(tmp_path.glob(".out.tmp-*"))
    exported = {k: v for f in files for k, v in load_file(out / f).items()}
    original = load_file(path / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in original.values())

    again = policy_for(path, parallel_info, seed=99)
    import_hf(again, out)
    ref = params(policy)
    for name, p in again.model.named_parameters():
        assert torch.equal(p, ref[name]), name


def test_export_loads_in_transformers(hf_ckpt, parallel_info, tmp_path):
    from moe_rl.tasks.tokenizer import CharTokenizer

    model, path = hf_ckpt
    policy = policy_for(path, parallel_info)
    import_hf(policy, path)
    with torch.no_grad():  # move off the original weights so the check is not trivial
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = export_hf(policy, tmp_path / "out", tokenizer=CharTokenizer())
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    c = loaded.config
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.head_dim) == (4, 2, True, 16)
    assert c.rope_parameters["rope_theta"] == 10000.0
    toks = tokens(1)
    assert gap(policy, model, toks) > 1e-3
    assert gap(policy, loaded, toks) < TOL


def test_fused_expert_checkpoint(hf_ckpt, parallel_info, tmp_path):
    """transformers 5 modules hold experts fused; a checkpoint saved from state_dict() loads too."""
    model, path = hf_ckpt
    state = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "fused" / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path / "fused" / "config.json")
    per_expert, fused = policy_for(path, parallel_info), policy_for(path, parallel_info, seed=7)
    import_hf(per_expert, path)
    import_hf(fused, tmp_path / "fused")
    ref = params(per_expert)
    for name, p in fused.model.named_parameters():
        assert torch.equal(p, ref[name]), name


_TINY = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
}


def test_config_round_trip(tiny_model_cfg):
    back = config_from_hf(hf_config(tiny_model_cfg), max_seq_len=tiny_model_cfg.max_seq_len)
    assert mismatches(back, tiny_model_cfg) == [] and back.max_seq_len == tiny_model_cfg.max_seq_len
    c = transformers.Qwen3MoeConfig(**hf_config(tiny_model_cfg))
    assert (c.num_experts, c.moe_intermediate_size, c.head_dim) == (4, 64, 16)
    assert c.rope_parameters["rope_theta"] == tiny_model_cfg.rope_theta
    assert config_from_hf(_TINY).moe_norm_topk_prob is True
    v5 = {k: v for k, v in _TINY.items() if k != "rope_theta"} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "num_local_experts": 4,
    }
    assert config_from_hf(v5).rope_theta == 5e5


@pytest.mark.parametrize(
    "change,field",
    [
        ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "architectures"),
        ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True, "sliding_window": 16}, "sliding_window"),
    ],
)
def test_unsupported_configs_are_refused(change, field):
    with pytest.raises(ConfigError, match=field):
        config_from_hf(_TINY | change)


def test_bad_checkpoints_are_refused_before_any_copy(hf_ckpt, parallel_info, tmp_path):
    _, path = hf_ckpt
    policy = policy_for(path, parallel_info)
    before = params(policy)
    original = load_file(path / "model.safetensors")
    hf_json = json.loads((path / "config.json").read_text())

    def broken(name, tensors, cfg=hf_json):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    q0 = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        (broken("missing", {k: v for k, v in original.items() if k != q0}), f"missing: {q0}"),
        (
            broken("extra", original | {"model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}),
            "unexpected: model.layers.0.mlp.shared_expert.weight",
        ),
        (broken("shape", original | {q0: torch.zeros(64, 63)}), f"{q0}: \\[64, 63\\]"),
        (
            broken(
                "config",
                original,
                hf_json | {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
            ),
            "rope_theta",
        ),
        (broken("unsupported", original, hf_json | {"attention_bias": True}), "attention_bias"),
    ]
    for d, msg in cases:
        with pytest.raises(ValueError, match=msg):
            import_hf(policy, d)
    for name, p in policy.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_source_and_sink(hf_ckpt, parallel_info):
    model, path = hf_ckpt
    policy = policy_for(path, parallel_info)
    import_hf(policy, path)
    original = load_file(path / "model.safetensors")
    source = PolicyHFSource(policy)
    streamed = dict(source.hf_tensors())
    assert streamed.keys() == original.keys()
    assert all(torch.equal(streamed[k], v) for k, v in original.items())
    meta = source.hf_param_meta()
    assert {k: s for k, (s, _) in meta.items()} == {k: tuple(v.shape) for k, v in original.items()}
    assert {d for _, d in meta.values()} == {torch.float32}
    assert next(PolicyHFSource(policy, dtype=torch.bfloat16).hf_tensors())[1].dtype == torch.bfloat16

    target = policy_for(path, parallel_info, seed=5)
    sink, before = PolicyHFSource(target), params(target)
    bad = list(streamed.items())
    bad[-1] = (bad[-1][0], torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        sink.load_hf_tensors(bad)
    with pytest.raises(ValueError, match="not a weight"):
        sink.load_hf_tensors([*streamed.items(), ("model.layers.9.mlp.gate.weight", torch.zeros(4, 64))])
    for name, p in target.model.named_parameters():
        assert torch.equal(p, before[name]), name
    sink.load_hf_tensors(streamed.items())
    toks = tokens(2)
    assert gap(target, model, toks) < TOL
    with torch.no_grad():
        assert torch.equal(target.logits(toks), policy.logits(toks))


def test_export_says_where_generation_stops_and_is_readable(hf_ckpt, parallel_info, tmp_path):
    """transformers' ``generate()`` reads ``eos_token_id`` from generation_config.json: without it
    a generation of the export never stopped. The shards were written 0600."""
    import os
    import stat

    from moe_rl.tasks.tokenizer import CharTokenizer

    _, path = hf_ckpt
    policy = policy_for(path, parallel_info)
    import_hf(policy, path)
    tok = CharTokenizer()
    out = export_hf(policy, tmp_path / "out", tokenizer=tok)
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.bos_token_id, gen.pad_token_id) == (tok.eos_id, tok.bos_id, tok.pad_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert model.generation_config.eos_token_id == tok.eos_id
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name


def test_an_exported_model_generates_and_stops_at_eos(hf_ckpt, parallel_info, tmp_path):
    """transformers' ``generate()`` on the export stops at the tokenizer's EOS, and only because the
    export says which id that is: the same model without that stop id runs to ``max_new_tokens``.
    The weights are set (after loading) so that every next token is EOS: the last hidden state's
    first coordinate is large and positive (embeddings), the final norm keeps only it, and only
    EOS's row of the output layer reads it. Files are written 0644 under the usual umask 022
    (the shards used to be 0600)."""
    import os
    import stat

    from moe_rl.tasks.tokenizer import CharTokenizer

    _, path = hf_ckpt
    policy = policy_for(path, parallel_info)
    import_hf(policy, path)
    tok = CharTokenizer()
    umask = os.umask(0o022)
    try:
        out = export_hf(policy, tmp_path / "out", tokenizer=tok)
    finally:
        os.umask(umask)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {
        f.name: 0o644 for f in out.iterdir()
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_id, 0] = 1.0
    prompt = torch.tensor([[tok.bos_id, *tok.encode("1+2=")]])
    n = prompt.shape[1]
    with torch.no_grad():
        assert int(model(prompt).logits[0, -1].argmax()) == tok.eos_id
        stopped = model.generate(prompt, max_new_tokens=6, do_sample=False)
        assert stopped[0, n:].tolist() == [tok.eos_id]  # one token: the EOS, then it stopped
        model.generation_config.eos_token_id = None  # as an export without generation_config.json
        ran_on = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_id)
        assert ran_on[0, n:].tolist() == [tok.eos_id] * 6


def test_an_export_keeps_the_source_models_generation_config(tmp_path):
    """A Hugging Face tokenizer directory's generation_config.json (a model's sampling defaults and
    its further stop ids, Qwen3's two) is kept, with the tokenizer's EOS among the stop ids."""
    from moe_rl.megatron.hf import _generation_config

    src = tmp_path / "qwen"
    src.mkdir()
    (src / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": [151645, 151643], "pad_token_id": 151643, "temperature": 0.6, "top_p": 0.95}
        )
    )

    class Tok:
        path, eos_id, bos_id, pad_id = src, 151645, None, 151643

    assert _generation_config(Tok()) == {
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_p": 0.95,
    }
    Tok.eos_id = 7  # a tokenizer whose EOS the source's list lacks: it stops there first
    assert _generation_config(Tok())["eos_token_id"] == [7, 151645, 151643]
