import subprocess
import sys
from pathlib import Path

import pytest

from configs.schema import CONFIG_DIR, ConfigError, RunConfig, load_config

PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


# settings a preset leaves to the user (configs/pretrained.yaml: the checkpoint directory; without it the config
# says so, tests/test_pretrained.py)
REQUIRED = {"pretrained": {"model.path": "/path/to/checkpoint"}}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name):
    cfg = load_config(name, REQUIRED.get(name))
    assert isinstance(cfg, RunConfig)
    assert cfg.gates.parity_mean_max == 0.1 and cfg.gates.parity_token_max == 1.0  # the seed's limits


def test_presets_exist():
    assert {"tiny", "qwen35-27b"} <= set(PRESETS)


def test_trl_names_and_defaults():
    g = RunConfig().grpo
    assert (g.loss_type, g.epsilon, g.beta, g.importance_sampling_level) == ("dapo", 0.2, 0.0, "token")
    assert g.vllm_importance_sampling_mode == "sequence_mask" and g.vllm_importance_sampling_clip_max == 3.0


def test_unknown_key_is_rejected_with_its_path(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("grpo:\n  loss_typ: dapo\n")
    with pytest.raises(ConfigError, match=r"grpo\.loss_typ: unknown key"):
        load_config(p)


@pytest.mark.parametrize("overrides, message", [
    ({"grpo.loss_type": "ppo"}, "loss_type"),
    ({"grpo.beta": 0.04}, "set beta: 0.0"),
    ({"grpo.loss_type": "cispo"}, "epsilon_high"),
    ({"steps.pattern": ["reuse", "fresh"]}, "must start with `fresh`"),
    ({"adapter.targets": ["conv1d"]}, "conv1d"),
    ({"sampler.kind": "vllm"}, "set model.dtype: bfloat16"),
    ({"sampler.kind": "vllm", "model.dtype": "bfloat16", "sampler.temperature": 2.5}, r"\[0.01, 2\]"),
    ({"sampler.mtp_tokens": 2}, "vLLM engine settings"),
    ({"model.quantization": "nf4"}, "bfloat16"),
    ({"model.quantization": "nf4", "model.dtype": "bfloat16"}, "set device: cuda"),
    ({"device": "tpu"}, "device"),
    ({"model.source": "pretrained"}, "model.path"),
    ({"device": "cuda", "model.attention_fp32": True}, "Set model.gdn_kernels: torch"),
    ({"grpo.max_log_ratio": 0.0}, "max_log_ratio"),
])
def test_invalid_combinations_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_unknown_section_in_override():
    with pytest.raises(ConfigError, match="nope: unknown key"):
        load_config("tiny", {"nope.x": 1})
    with pytest.raises(ConfigError, match="`seed` in override `seed.x` is a value"):
        load_config("tiny", {"seed.x": 1})


def test_override_of_a_section_the_file_leaves_at_defaults():
    cfg = load_config("tiny", {"gym.tool_server.faults.rate": 0.2, "gym.tool_server.timeout_s": 0.5})
    assert cfg.gym.tool_server.faults.rate == 0.2 and cfg.gym.tool_server.timeout_s == 0.5
    with pytest.raises(ConfigError, match="gym.tool_server.nope: unknown key"):
        load_config("tiny", {"gym.tool_server.nope": 1})


def test_missing_preset_lists_presets():
    with pytest.raises(ConfigError, match="tiny"):
        load_config("does-not-exist")


def test_configs_and_flows_import_without_torch():
    code = ("import sys; import configs, configs.schema, flows.train, flows.step, flows.rerun, flows.tasks; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    res = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_mtp_with_prefix_caching_on_a_hybrid_is_rejected_before_any_model_loads():
    """The seeds' rule: checked by the schema (no torch, no vLLM import, nothing loaded)."""
    import subprocess
    import sys

    vllm = {"sampler.kind": "vllm", "model.dtype": "bfloat16", "adapter.train_final_norm": False}
    with pytest.raises(ConfigError, match="rejected on a hybrid .*Turn one of them off"):
        load_config("tiny", {**vllm, "sampler.mtp_tokens": 2, "sampler.prefix_caching": True})
    assert load_config("tiny", {**vllm, "sampler.mtp_tokens": 2}).sampler.mtp_tokens == 2  # MTP alone: allowed
    assert load_config("tiny", {**vllm, "sampler.prefix_caching": True}).sampler.prefix_caching  # caching alone
    # a model without linear-attention layers is not a hybrid: the combination is allowed there
    dense = load_config("tiny", {**vllm, "sampler.mtp_tokens": 2, "sampler.prefix_caching": True,
                                 "model.arch.layer_types": ["full_attention"] * 4})
    assert not dense.model_is_hybrid()
    code = ("import sys; from configs.schema import load_config, ConfigError\n"
            "try:\n load_config('tiny', {'sampler.kind': 'vllm', 'model.dtype': 'bfloat16', 'adapter.train_final_norm': False, 'sampler.mtp_tokens': 1,"
            " 'sampler.prefix_caching': True})\nexcept ConfigError: pass\n"
            "assert not {'torch', 'vllm'} & set(sys.modules), 'the guard must not import torch or vllm'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=__file__.rsplit("/tests/", 1)[0])


def test_cuda_without_a_gpu_fails_with_a_message_saying_what_to_change():
    import torch

    from engine.runtime import check_device

    cfg = load_config("tiny", {"device": "cuda"})
    if torch.cuda.is_available():
        check_device(cfg)  # nothing to complain about
        return
    with pytest.raises(RuntimeError, match="sees no CUDA GPU.*set device: cpu"):
        check_device(cfg)


@pytest.mark.parametrize("override, message", [
    ({"model.arch.linear_key_head_dim": 32}, r"linear_key_head_dim=32: .*64 or 128 only"),
    ({"model.arch.linear_value_head_dim": 96}, r"linear_value_head_dim=96: .*64 or 128 only"),
    ({"model.arch.hiden_size": 64}, r"unknown key\(s\) \['hiden_size'\] .*known keys: .*hidden_size"),
    ({"model.arch.eos_token_id": 3}, r"token ids come from the tokenizer"),
    ({"model.arch.layer_types": ["linear_attention", "full_attention"]}, r"lists 2 layers but num_hidden_layers=4"),
    ({"model.arch.layer_types": ["linear_attention"] * 3 + ["sliding"]}, r"entries are linear_attention or full"),
    ({"model.arch.num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"model.arch.linear_num_value_heads": 3}, r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    ({"model.arch.hidden_size": 0}, r"hidden_size=0: must be a positive integer"),
])
def test_architecture_rules_are_checked_at_load_time_with_the_fix(override, message):
    """Issue 15: `linear_key_head_dim: 32` used to pass load_config and fail 31 s later inside the bootstrap task;
    a misspelled arch key built Qwen3_5TextConfig's default-sized model silently."""
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", override)

