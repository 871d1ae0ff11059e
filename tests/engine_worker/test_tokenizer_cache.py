"""The on-disk memo of GGUF tokenizers: same ids from the cache, and a broken entry is rebuilt."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_worker.model.registry import smollm2_gguf_path
from engine_worker.tokenizer import _from_gguf_disk_cached

TEXT = "Hello, world! Ünïcödé 🚀 and code: def f(x): return x ** 2  # 12345"


def test_cached_tokenizer_equals_the_rebuilt_one_and_survives_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTER_CACHE_DIR", str(tmp_path))
    path = str(smollm2_gguf_path())
    built = _from_gguf_disk_cached(path)
    entries = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(entries) == 1
    cached = _from_gguf_disk_cached(path)
    assert cached.encode(TEXT) == built.encode(TEXT)
    assert cached.eos_token_ids == built.eos_token_ids
    assert cached.chat_template == built.chat_template
    entries[0].write_text("{ not json")
    rebuilt = _from_gguf_disk_cached(path)
    assert rebuilt.encode(TEXT) == built.encode(TEXT)
