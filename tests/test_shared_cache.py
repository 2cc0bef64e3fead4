"""The cache shared by runs (issue 15): a second run of a preset in a new run directory takes its tokenizer,
bootstrapped base and export from the cache, bit for bit what it would have built; a corrupted entry is rebuilt
with a warning, never used."""

from __future__ import annotations

import logging

from tests.conftest import make_run


def test_second_run_reuses_tokenizer_base_and_export_and_a_corrupted_entry_is_rebuilt(tmp_path, monkeypatch, caplog):
    from artifacts import dir_digest, read_json
    from stages.export import export_base

    cache = tmp_path / "cache"
    monkeypatch.setenv("LGRPO_CACHE_DIR", str(cache))

    def prepared(name: str) -> tuple[dict, dict]:
        run = make_run(tmp_path / name, **{"bootstrap.episodes": 16})
        prep = read_json(f"{run}/prepared.json")
        return prep, export_base(run, prep["base"])

    first, ex1 = prepared("first")
    assert first["bootstrap"]["cached"] is False and ex1["cached"] is False
    assert {p.name for p in cache.iterdir()} == {"tokenizer", "bootstrap", "export"}

    second, ex2 = prepared("second")  # a new run directory: everything from the cache
    assert second["bootstrap"]["cached"] == "shared" and ex2["cached"] == "shared"
    assert dir_digest(second["base"]) == dir_digest(first["base"])
    assert dir_digest(second["tokenizer"]) == dir_digest(first["tokenizer"])
    assert dir_digest(ex2["path"]) == dir_digest(ex1["path"])

    entry = next((cache / "bootstrap").iterdir())
    weights = next(entry.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    weights.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="lgrpo.cache"):
        third, _ = prepared("third")
    assert third["bootstrap"]["cached"] is False  # rebuilt, not used
    assert any("does not verify" in r.message and "rebuilding" in r.message for r in caplog.records)
    assert dir_digest(third["base"]) == dir_digest(first["base"])  # the rebuild is bit-identical
    assert dir_digest(entry) == dir_digest(first["base"])  # and the cache holds a valid entry again

    monkeypatch.setenv("LGRPO_CACHE_DIR", "off")
    off, _ = prepared("off")
    assert off["bootstrap"]["cached"] is False


def test_cuda_kernel_choices_do_not_key_a_cpu_runs_preparation():
    """On a CPU run the CUDA kernel settings choose nothing (every one runs the PyTorch path): changing one must not
    bootstrap the base again; on a CUDA run they stay in the key, and settings that change the arithmetic always do."""
    from configs.schema import config_hash, load_config
    from stages.bootstrap import CUDA_ONLY_MODEL_SETTINGS, preparation_config

    def key(cfg):
        return config_hash(preparation_config(cfg), "model", "bootstrap", "latent", "gym", "tokenizer")

    cpu = load_config("tiny")
    for k in CUDA_ONLY_MODEL_SETTINGS:
        assert key(cpu.with_overrides(**{f"model.{k}": "torch"})) == key(cpu), k
    assert key(cpu.with_overrides(**{"model.init_seed": 1})) != key(cpu)
    gpu = cpu.with_overrides(device="cuda")
    assert key(gpu.with_overrides(**{"model.attention_kernels": "torch"})) != key(gpu)
