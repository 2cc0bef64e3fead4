"""Training a local checkpoint in the published Qwen3.5 layout (tests/qwen_snapshot.py): loaded in place, its own
tokenizer and chat template, two GRPO steps through Prefect with every gate, a changed checkpoint refused."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.qwen_snapshot import build_snapshot, qwen_vocabulary

# small enough for two CPU steps in seconds; the pipeline and gates are the real ones
SMALL = {"device": "cpu", "model.dtype": "float32", "threads": 1, "adapter.type": "lora", "grpo.groups_per_step": 1,
         "grpo.num_generations": 2, "gym.max_turns": 2, "gym.eval_tasks": 2, "sampler.max_answer_tokens": 8,
         "latent.max_latent_steps": 2, "steps.total": 2, "gates.probe_prompts": 2}


@pytest.fixture(scope="module")
def vocabulary():
    return qwen_vocabulary()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, vocabulary) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("Qwen3.5-tiny")
    return d, build_snapshot(d, vocabulary=vocabulary)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def test_the_published_layout_loads_its_text_model_in_place(snapshot, tmp_path):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from artifacts import checkpoint
    from engine import model as M

    src, info = snapshot
    record = checkpoint.hash_checkpoint(src)
    ref_dir = tmp_path / "bootstrap" / "pretrained-x"
    checkpoint.write_ref(ref_dir, record)
    assert _du(ref_dir) < 64 * 1024, "the run holds a reference, not the weights"
    text = M.load_base(ref_dir, "float32")
    assert type(text).__name__ == "Qwen3_5ForCausalLM"
    full = Qwen3_5ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32)
    ref = full.state_dict()
    got = text.state_dict()
    assert len(got) == sum(1 for k in ref if k.startswith("model.language_model.") or k == "lm_head.weight")
    for k, v in got.items():  # every text tensor equals the published one under model.language_model.*
        pub = "lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]
        assert torch.equal(v, ref[pub]), k
    assert not any("visual" in k or k.startswith("mtp.") for k in got)
    assert sorted(M.mtp_tensors(src)) == info["mtp_keys"]


def test_a_changed_checkpoint_is_refused_and_a_touched_one_is_not(snapshot, tmp_path):
    import shutil

    from artifacts import checkpoint

    src = tmp_path / "ckpt"
    shutil.copytree(snapshot[0], src)
    ref = checkpoint.hash_checkpoint(src)
    assert checkpoint.check_unchanged(ref)["hashed"] == []  # stat only: nothing read again
    cfg_file = src / "config.json"
    os.utime(cfg_file, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: same bytes, re-hashed, accepted
    assert checkpoint.check_unchanged(ref)["hashed"] == ["config.json"]
    shard = sorted(src.glob("model-0000*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointChanged, match=shard.name + ".*changed since this run recorded it"):
        checkpoint.check_unchanged(ref)
    shard.unlink()
    with pytest.raises(checkpoint.CheckpointChanged, match="missing"):
        checkpoint.check_unchanged(ref)


def test_the_checkpoint_template_writes_prompts_tools_and_results(snapshot):
    from engine.chat import ChatFormat, tool_specs
    from engine.model import Tokens
    from engine.tokenizer import load_tokenizer
    from gyms.table import TableGym
    from gyms.tools import parse_tool_call

    src, info = snapshot
    tok = load_tokenizer(src)
    fmt = ChatFormat.of(tok)
    env = TableGym()
    prompt = fmt.first_prompt('What is "alpha" plus "beta"?', tool_specs(env))
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "lookup"' in prompt
    assert prompt.endswith('<|im_start|>user\nWhat is "alpha" plus "beta"?<|im_end|>\n<|im_start|>assistant\n')
    # the template's thinking slot is where the trainer writes <think> z </think>: the prompt stops before it
    assert fmt.observation_block("17") == "\n<|im_start|>user\n<tool_response>\n17\n</tool_response><|im_end|>\n" \
                                          "<|im_start|>assistant\n"
    toks = Tokens.of(tok)
    if info["vocab"] == "real":  # the ids of the published Qwen3.5/3.6 tokenizer
        assert (toks.pad, toks.eos, toks.think, toks.answer_open) == (248044, 248046, 248068, 248069)
    # the template's own tool-call form is what the built-in gyms parse
    call = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "alpha"}}}]}], tokenize=False)
    answer = call.split("</think>\n\n", 1)[1].split("<|im_end|>")[0]
    parsed = parse_tool_call(answer, env.tools)
    assert parsed.name == "lookup" and parsed.arguments == {"key": "alpha"}, parsed


def test_bootstrap_is_refused_for_a_real_checkpoint():
    from configs.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="bootstrap.enabled: false"):
        load_config("pretrained", {"model.path": "/x", "bootstrap.enabled": True})
    with pytest.raises(ConfigError, match="--set model.path="):
        load_config("pretrained")


@pytest.mark.slow
def test_two_steps_from_a_published_snapshot_through_prefect(prefect_harness, snapshot, tmp_path, monkeypatch):
    from artifacts import RunDir, checkpoint, read_json
    from configs.params import TrainParameters
    from flows.train import train

    src, info = snapshot
    cache = tmp_path / "cache"
    monkeypatch.setenv("LGRPO_CACHE_DIR", str(cache))  # the per-file hashes are shared by runs through it
    overrides = {**SMALL, "model.path": str(src)}

    def run(name: str):
        t0 = time.perf_counter()
        state = train(params=TrainParameters(config="pretrained", run_dir=str(tmp_path / name), overrides=overrides),
                      return_state=True)
        assert state.is_completed(), state
        return state.result(), time.perf_counter() - t0

    summary, first_s = run("first")
    rd = RunDir(tmp_path / "first")
    assert [s["kind"] for s in summary["steps"]] == ["fresh", "reuse"]
    assert summary["verified_checkpoint"]["identical"], summary["verified_checkpoint"]
    for step in (0, 1):
        assert read_json(rd.parity(0))["passed"]
    assert all(s["grad_norm"] is not None for s in summary["steps"])
    boot = summary["bootstrap"]
    assert boot["source"] == str(src.resolve()) and boot["files_hashed"] == boot["files"]
    # nothing of the checkpoint's weights was copied: the run holds references; its tokenizer files (and chat
    # template) are sealed into <run>/tokenizer/, the rest is the run's own artifacts (adapters, optimizer, tables)
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    own = _du(rd.root) - _du(rd.root / "tokenizer")
    assert own < weights / 10, (own, weights)
    assert {p.name for p in rd.root.rglob("*.safetensors")} <= {"adapter_model.safetensors", "optimizer.safetensors"}
    print(f"\ncheckpoint weights {weights / 1e6:.1f} MB; run directory {_du(rd.root) / 1e6:.1f} MB, of which the "
          f"sealed tokenizer {_du(rd.root / 'tokenizer') / 1e6:.1f} MB; first run {first_s:.1f} s, its bootstrap stage "
          f"(hashing {boot['files']} files) {boot['wall_s']:.3f} s")

    # a second run on the same checkpoint reads no checkpoint file again (hashes cached by path, size and mtime)
    summary2, second_s = run("second")
    assert summary2["bootstrap"]["files_hashed"] == 0 and summary2["bootstrap"]["digest"] == boot["digest"]
    print(f"second run on the same checkpoint {second_s:.1f} s, its bootstrap stage "
          f"{summary2['bootstrap']['wall_s']:.3f} s, files hashed: {summary2['bootstrap']['files_hashed']}")

    # the checkpoint changes under the first run: resuming it is refused with a message naming the file
    shard = sorted(src.glob("model-0000*.safetensors"))[-1]
    saved = shard.read_bytes()
    try:
        data = bytearray(saved)
        data[-1] ^= 0x01
        shard.write_bytes(bytes(data))
        state = train(params=TrainParameters(config="pretrained", run_dir=str(tmp_path / "first"),
                                             overrides=overrides), return_state=True)
        assert state.is_failed()
        with pytest.raises(checkpoint.CheckpointChanged, match=shard.name):
            state.result()
    finally:
        shard.write_bytes(saved)


def test_a_written_export_keeps_the_mtp_head_and_the_chat_template(snapshot, tmp_path):
    """vLLM loads its own written export (text model in its dtype): the checkpoint's MTP tensors and its tokenizer
    files with the chat template travel with it, as stored."""
    import torch
    from safetensors.torch import load_file

    from configs.schema import load_config
    from engine import model as M
    from stages.export import export_base
    from stages.prepare import init_run_dir, prepare_run

    src, info = snapshot
    cfg = load_config("pretrained", {**SMALL, "model.path": str(src), "run_dir": str(tmp_path / "run"),
                                     "sampler.kind": "vllm", "model.dtype": "bfloat16"})
    run_dir = str(init_run_dir(cfg).root)
    prep = prepare_run(run_dir)
    ex = export_base(run_dir, prep["base"]["path"])
    out = Path(ex["path"])
    assert not ex.get("in_place") and ex["mtp_tensors"] == len(info["mtp_keys"])
    mtp = load_file(str(out / "mtp.safetensors"))
    stored = M.mtp_tensors(src)
    assert sorted(mtp) == info["mtp_keys"] and all(torch.equal(mtp[k], stored[k]) for k in mtp)
    assert (out / "chat_template.jinja").read_text() == (src / "chat_template.jinja").read_text()
    text = M.load_base(out, "bfloat16")  # the export is a plain Qwen3_5ForCausalLM checkpoint of the same weights
    ref = M.load_base(prep["base"]["path"], "bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(text.state_dict().values(), ref.state_dict().values()))


@pytest.mark.gpu
def test_the_published_layout_loads_as_an_nf4_base_on_the_gpu(snapshot, tmp_path):
    import torch

    from artifacts import checkpoint
    from engine import model as M
    from engine.nf4 import load_base_nf4

    src, _ = snapshot
    ref_dir = tmp_path / "ref"
    checkpoint.write_ref(ref_dir, checkpoint.hash_checkpoint(src))
    q = load_base_nf4(ref_dir, device="cuda")
    bf = M.load_base(ref_dir, "bfloat16", "cuda")
    ids = torch.arange(1, 33, device="cuda").view(1, -1)
    with torch.no_grad():
        a, b = q(ids).logits.float(), bf(ids).logits.float()
    assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 0.2  # NF4 of the same text weights
