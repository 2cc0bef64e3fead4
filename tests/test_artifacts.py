"""artifacts/: atomic, hash-verified storage and the run-directory layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import artifacts
from artifacts import (
    ArtifactError,
    RunDir,
    append_jsonl,
    dir_digest,
    read_adapter_dir,
    read_json,
    read_jsonl,
    read_table,
    read_tensors,
    sha256_file,
    sidecar_path,
    table_metadata,
    to_tensor,
    to_tensor_list,
    verify,
    write_adapter_dir,
    write_json,
    write_table,
    write_tensors,
)

REPO = Path(__file__).resolve().parents[1]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (unlike torch.equal, distinguishes -0.0 / 0.0 and NaN payloads)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.clone().reshape(-1).view(torch.uint8), b.clone().reshape(-1).view(torch.uint8))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------- tables


def test_table_round_trip_with_ragged_and_2d_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 1000, size=n, dtype=np.int32) for n in (3, 0, 5)]
    logps = [rng.standard_normal(n).astype(np.float32) for n in (3, 0, 5)]
    thoughts = [rng.standard_normal((k, 8)).astype(np.float32) for k in (2, 1, 4)]
    vectors = rng.standard_normal((3, 8)).astype(np.float32)
    path = tmp_path / "turn-01.arrow"

    digest = write_table(
        path,
        {
            "row": np.arange(3, dtype=np.int64),
            "tokens": tokens,
            "logps": logps,
            "thoughts": thoughts,
            "last": vectors,
            "answer": ["a", "bb", ""],
        },
        metadata={"step": "1"},
    )

    assert digest == sha256_file(path) == verify(path)
    assert sidecar_path(path).read_text().split() == [digest, str(path.stat().st_size)]
    table = read_table(path)
    assert table_metadata(table) == {"step": "1"}
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert table.schema.field("logps").type == pa.list_(pa.float32())
    assert table.schema.field("thoughts").type == pa.list_(pa.list_(pa.float32(), 8))
    assert table.schema.field("last").type == pa.list_(pa.float32(), 8)
    assert table.column("answer").to_pylist() == ["a", "bb", ""]
    for got, want in zip(to_tensor_list(table, "tokens"), tokens, strict=True):
        assert bitwise_equal(got, torch.from_numpy(want))
    for got, want in zip(to_tensor_list(table, "thoughts"), thoughts, strict=True):
        assert bitwise_equal(got, torch.from_numpy(want))
    assert bitwise_equal(to_tensor(table, "last"), torch.from_numpy(vectors))
    assert bitwise_equal(to_tensor(table, "row"), torch.arange(3))


def test_table_schema_pins_types_and_allows_empty(tmp_path: Path) -> None:
    schema = pa.schema([("tokens", pa.list_(pa.int32())), ("reward", pa.float32())])
    write_table(tmp_path / "empty.arrow", {"tokens": [], "reward": []}, schema=schema)
    assert read_table(tmp_path / "empty.arrow").schema == schema
    write_table(tmp_path / "py.arrow", {"tokens": [[1, 2], [3]], "reward": [0.5, 1.0]}, schema=schema)
    assert read_table(tmp_path / "py.arrow").schema == schema
    with pytest.raises(ValueError, match="different row counts"):
        write_table(tmp_path / "bad.arrow", {"a": np.zeros(2), "b": np.zeros(3)})


# --------------------------------------------------------------------------------------- tensors


def test_tensors_round_trip_bitwise(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(4, 5, generator=g)
    f32[0, 0] = -0.0
    f32[0, 1] = float("nan")
    tensors = {
        "f32": f32,
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (6,), generator=g),
        "strided": torch.randn(4, 6, generator=g).t(),
    }
    path = tmp_path / "optimizer.safetensors"
    digest = write_tensors(path, tensors, metadata={"step": "3"})

    loaded, metadata = read_tensors(path)
    assert metadata == {"step": "3"}
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert bitwise_equal(loaded[name], tensor.contiguous()), name
    assert verify(path) == digest
    assert write_tensors(tmp_path / "again.safetensors", tensors, metadata={"step": "3"}) == digest  # deterministic


# ------------------------------------------------------------------------------------------ json


def test_json_round_trip_and_jsonl(tmp_path: Path) -> None:
    obj = {"loss": 0.25, "modules": {"v_proj", "q_proj"}, "nested": {"b": [1, 2], "a": None}}
    path = tmp_path / "optimize.json"
    digest = write_json(path, obj)
    assert read_json(path) == {"loss": 0.25, "modules": ["q_proj", "v_proj"], "nested": {"a": None, "b": [1, 2]}}
    assert verify(path) == digest

    history = tmp_path / "parity_history.jsonl"
    append_jsonl(history, {"step": 1, "max_abs": 0.0})
    append_jsonl(history, {"step": 2, "max_abs": 1e-7, "note": "line\nbreak"})
    lines = history.read_text().splitlines()
    assert len(lines) == 2
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert read_jsonl(history)[1]["note"] == "line\nbreak"

    # re-running step 1 (a resumed run) replaces its record instead of adding a second one; order is kept
    append_jsonl(history, {"step": 1, "max_abs": 0.5}, replace="step")
    append_jsonl(history, {"step": 4, "max_abs": 0.25}, replace="step")
    assert [(r["step"], r["max_abs"]) for r in read_jsonl(history)] == [(2, 1e-7), (1, 0.5), (4, 0.25)]
    assert not list(tmp_path.glob("*.tmp*"))
    history.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1)))

    with open(history, "ab") as f:  # a crash mid-append leaves a torn last line
        f.write(b'{"step": 3, "max')
    with pytest.raises(ArtifactError, match=r"parity_history\.jsonl.*incomplete"):
        append_jsonl(history, {"step": 3})
    with pytest.raises(ArtifactError, match=r"parity_history\.jsonl.*line 3"):
        read_jsonl(history)


# ------------------------------------------------------------------------------- verification


@pytest.fixture
def written(tmp_path: Path) -> Path:
    path = tmp_path / "rollouts.arrow"
    write_table(path, {"x": np.arange(100, dtype=np.float32)})
    return path


def test_flipped_byte_is_reported_as_corrupted(written: Path) -> None:
    flip_byte(written, written.stat().st_size // 2)
    with pytest.raises(ArtifactError, match=r"rollouts\.arrow.*corrupted") as info:
        read_table(written)
    assert info.value.path == written
    assert "re-run the stage" in str(info.value)


def test_truncated_file_is_reported(written: Path) -> None:
    data = written.read_bytes()
    written.write_bytes(data[: len(data) - 10])
    with pytest.raises(ArtifactError, match=r"rollouts\.arrow.*truncated.*bytes"):
        read_table(written)


def test_missing_sidecar_and_missing_file(written: Path, tmp_path: Path) -> None:
    sidecar_path(written).unlink()
    with pytest.raises(ArtifactError, match=r"rollouts\.arrow.*sidecar rollouts\.arrow\.sha256 is missing"):
        verify(written)
    with pytest.raises(ArtifactError, match=r"nope\.json.*missing"):
        read_json(tmp_path / "nope.json")


def test_malformed_sidecar(written: Path) -> None:
    sidecar_path(written).write_text("not a digest\n")
    with pytest.raises(ArtifactError, match=r"rollouts\.arrow\.sha256.*malformed"):
        verify(written)


def test_failed_write_leaves_previous_version_intact(written: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = read_table(written)

    def failing_replace(src: object, dst: object) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        write_table(written, {"x": np.zeros(5, dtype=np.float32)})
    monkeypatch.undo()

    assert read_table(written).equals(before)
    assert sorted(p.name for p in written.parent.iterdir()) == ["rollouts.arrow", "rollouts.arrow.sha256"]


def test_crash_between_data_and_sidecar_rename_is_detected(written: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_replace = os.replace
    calls: list[object] = []

    def replace_data_then_fail(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) > 1:
            raise OSError("power loss (simulated)")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_data_then_fail)
    with pytest.raises(OSError, match="simulated"):
        write_table(written, {"x": np.zeros(5, dtype=np.float32)})
    monkeypatch.undo()
    with pytest.raises(ArtifactError, match=r"rollouts\.arrow"):  # never a silently wrong read
        read_table(written)


def test_writer_raising_midway_leaves_no_target(tmp_path: Path) -> None:
    path = tmp_path / "fresh.json"

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b'{"partial":')
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        artifacts.atomic_write(path, half_then_fail)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------- directories


def test_dir_digest_and_adapter_replace(tmp_path: Path) -> None:
    config = {"peft_type": "LORA", "r": 4, "target_modules": {"q_proj"}}
    target = tmp_path / "step-0001" / "adapter"
    d1 = write_adapter_dir(target, config, {"a": torch.ones(2)})
    assert d1 == dir_digest(target)
    d2 = write_adapter_dir(target, config, {"a": torch.zeros(2)})
    assert d2 != d1
    assert bitwise_equal(read_adapter_dir(target)[1]["a"], torch.zeros(2))
    assert sorted(p.name for p in target.parent.iterdir()) == ["adapter"]  # no temp or backup left

    with pytest.raises(TypeError, match="torch.Tensor"):  # fails midway: the previous adapter survives
        write_adapter_dir(target, config, {"a": [1.0, 2.0]})  # type: ignore[dict-item]
    assert dir_digest(target) == d2
    assert sorted(p.name for p in target.parent.iterdir()) == ["adapter"]

    flip_byte(target / "adapter_model.safetensors", -1)
    with pytest.raises(ArtifactError, match="adapter_model.safetensors"):
        dir_digest(target)


def test_dir_digest_lists_a_tree_as_rglob_did(tmp_path: Path) -> None:
    """dir_digest walks with one scandir per directory (cache keys list the same directories for every task): the
    same files as ``rglob('*')`` + ``is_file()`` -- nested files by their relative posix names, symlinked files
    followed, symlinked directories not entered, leftover temporary files of interrupted writes left out -- and the
    same errors."""
    from artifacts import store

    root = tmp_path / "tree"
    write_json(root / "a.json", {"a": 1})
    write_json(root / "sub" / "deep" / "b.json", {"b": 2})
    write_json(tmp_path / "outside" / "c.json", {"c": 3})
    (root / "linked-dir").symlink_to(tmp_path / "outside", target_is_directory=True)
    (root / "linked.json").symlink_to(root / "a.json")
    (root / "linked.json.sha256").symlink_to(root / "a.json.sha256")
    (root / f".a.json{store._TMP_MARK}0123").write_text("half-written")

    def by_rglob(path: Path) -> str:  # the listing dir_digest used before
        entries = []
        for f in sorted(p for p in path.rglob("*") if p.is_file() and not store._is_temp_name(p.name)):
            if not f.name.endswith(store.SIDECAR_SUFFIX):
                entries.append((f.relative_to(path).as_posix(), verify(f)))
        return store._dir_digest_of(entries)

    rels = sorted(rel for rel, _, _ in store._dir_files(root))
    assert rels == ["a.json", "a.json.sha256", "linked.json", "linked.json.sha256", "sub/deep/b.json",
                    "sub/deep/b.json.sha256"]
    assert dir_digest(root) == by_rglob(root)
    (root / "sub" / "deep" / "b.json").unlink()
    with pytest.raises(ArtifactError, match="sidecar without its artifact"):
        dir_digest(root)


def test_verified_digest_is_remembered_only_while_file_and_sidecar_are_unchanged(tmp_path: Path, monkeypatch) -> None:
    """Cache keys ask for the same artifacts' digests many times (content_digest): a settled file is hashed once, and
    any write to it or its sidecar -- in place (a flipped byte) or an atomic replace -- is hashed and verified again."""
    from artifacts import store

    calls = []
    real = store.sha256_file
    monkeypatch.setattr(store, "sha256_file", lambda p: calls.append(Path(p).name) or real(p))
    monkeypatch.setattr(store, "_SETTLED_NS", 0)  # the files below are fresh: settle them at once
    f = tmp_path / "t.json"
    d1 = write_json(f, {"a": 1})
    assert store.verified_digest(f) == d1 == verify(f)
    calls.clear()
    assert store.verified_digest(f) == d1 and calls == []  # remembered
    flip_byte(f, 2)  # in place: same size, new mtime/ctime
    with pytest.raises(ArtifactError, match="t.json"):
        store.verified_digest(f)
    d2 = write_json(f, {"a": 2})  # atomic replace
    assert store.verified_digest(f) == d2 != d1
    write_adapter_dir(tmp_path / "ad", {"peft_type": "LORA", "r": 4}, {"a": torch.ones(2)})
    assert store.content_digest(tmp_path / "ad") == dir_digest(tmp_path / "ad")
    flip_byte(tmp_path / "ad" / "adapter_model.safetensors", -1)
    with pytest.raises(ArtifactError, match="adapter_model.safetensors"):
        store.content_digest(tmp_path / "ad")


def test_verified_digest_does_not_remember_a_file_written_within_the_clock_tick(tmp_path: Path) -> None:
    """A file written just now may be written again within the same coarse timestamp tick with the same size: its
    digest is not remembered until its timestamps are settled."""
    from artifacts import store

    f = tmp_path / "t.json"
    write_json(f, {"a": 1})
    store.verified_digest(f)
    assert str(f.resolve()) not in store._VERIFIED


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_adapter_dir_loads_with_peft_bitwise(tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(
        LlamaForCausalLM(cfg),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    state = get_peft_model_state_dict(peft_model)
    config = peft_model.peft_config["default"].to_dict()
    assert isinstance(config["target_modules"], set)  # why write_json encodes sets

    digest = write_adapter_dir(tmp_path / "adapter", config, state)
    assert dir_digest(tmp_path / "adapter") == digest
    stored_config, stored = read_adapter_dir(tmp_path / "adapter")
    assert stored_config["target_modules"] == ["q_proj", "v_proj"]

    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(LlamaForCausalLM(cfg), tmp_path / "adapter")
    reloaded = get_peft_model_state_dict(loaded)
    assert set(reloaded) == set(state) == set(stored) and len(state) == 8
    for name, tensor in state.items():
        assert bitwise_equal(reloaded[name], tensor), name
        assert bitwise_equal(stored[name], tensor), name


# -------------------------------------------------------------------------------------- layout


def test_run_dir_layout(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").ensure(step=1)
    assert run.config() == tmp_path / "run" / "config.yaml"
    assert run.step_dir(1).name == "step-0001" and run.step_dir(1).is_dir()
    assert run.turn(1, 1).relative_to(run.root).as_posix() == "step-0001/turn-01.arrow"
    assert run.gym_turn(12, 3).relative_to(run.root).as_posix() == "step-0012/gym-03.arrow"
    names = [run.rollouts(1), run.replay(1), run.parity(1), run.loss(1), run.adapter(1), run.optimizer(1)]
    assert [p.name for p in names] == [
        "rollouts.arrow", "replay.arrow", "parity.json", "optimize.json", "adapter", "optimizer.safetensors"
    ]
    assert (run.timings(1).name, run.metrics(1).name) == ("timings.json", "metrics.json")
    assert run.parity_history() == run.root / "parity_history.jsonl"
    assert run.metrics_history() == run.root / "metrics.jsonl"
    assert run.export_dir("abc").relative_to(run.root).as_posix() == "export/abc"
    assert run.bootstrap_dir("k").relative_to(run.root).as_posix() == "bootstrap/k"
    assert run.tokenizer_dir("k").relative_to(run.root).as_posix() == "tokenizer/k"
    run.ensure(step=3)
    assert run.steps() == [1, 3]
    with pytest.raises(ValueError, match="step"):
        run.step_dir(-1)
    with pytest.raises(ValueError, match="path component"):
        run.export_dir("../x")


def test_import_does_not_pull_in_torch() -> None:
    code = "import sys, artifacts; assert 'torch' not in sys.modules, 'artifacts imported torch'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_step_metrics_are_declared_once_and_flow_to_record_scalars_and_cli(monkeypatch):
    from artifacts import metrics as SM

    by = {"collect-rollouts": {"stage": "collect-rollouts", "reward_mean": 0.5, "success_rate": 0.25},
          "replay": {"stage": "replay", "parity_mean": 1e-3, "parity_max": 0.01, "masked": 2, "tokens": 900},
          "optimize": {"stage": "optimize", "loss": -0.125, "grad_norm": 3.0, "signal": True}}
    rec = SM.from_summaries(by)
    assert rec == {"reward_mean": 0.5, "success_rate": 0.25, "parity_mean": 1e-3, "parity_max": 0.01,
                   "parity_masked": 2, "replay_tokens": 900, "loss": -0.125, "grad_norm": 3.0, "signal": True}
    rec |= {"prefix_computed_share": 0.29, "stage_seconds": 4.0, "phases": {"replay": 1.5}}
    sc = SM.scalars(rec)
    assert sc["train/reward"] == 0.5 and sc["optim/loss"] == -0.125 and sc["seconds/replay"] == 1.5
    assert sc["train/completion"] is None  # declared, absent this step
    assert SM.line(rec) == "reward=0.500 success=0.250 loss=-0.1250 prefix computed=29%"
    # a new metric is one declaration: the record, the scalars and the CLI pick it up
    monkeypatch.setattr(SM, "STEP_METRICS", SM.STEP_METRICS + (
        SM.StepMetric("kl", "optimize", key="k3_kl", scalar="optim/kl", column="kl", fmt="{:.2f}", line=True),))
    by["optimize"]["k3_kl"] = 0.5
    rec = SM.from_summaries(by)
    assert rec["kl"] == 0.5 and SM.scalars(rec)["optim/kl"] == 0.5
    assert SM.line(rec).endswith("kl=0.50") and [m.column for m in SM.columns()][-1] == "kl"
