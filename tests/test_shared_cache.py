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
