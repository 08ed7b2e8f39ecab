"""Locating and loading the shipped GGUF model: the config is parsed once per file and process."""

import transformers

from kvbackend.tools import models
from kvbackend.tools.evaluate import model_geometry


class _Config:
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 3, 4, 2, 64


def test_the_config_is_parsed_once_per_file(tmp_path, monkeypatch):
    """The CLI checks specs against the model's geometry before loading it: that parse (seconds for a GGUF file) is
    reused by later calls for the same file, and another file gets its own."""
    calls = []

    def from_pretrained(directory, gguf_file=None):
        calls.append((directory, gguf_file))
        return _Config()

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    models._config_of.cache_clear()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    geometry = model_geometry(str(tmp_path))
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (3, 2, 16)
    assert models.load_config(model_dir=str(tmp_path)) is models.load_config("SmolLM2-135M-Instruct", str(tmp_path))
    assert calls == [(str(tmp_path), "a.gguf")]  # the first .gguf of the folder, parsed once
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.gguf").write_bytes(b"")
    models.load_config(model_dir=str(other))
    assert calls[-1] == (str(other), "c.gguf") and len(calls) == 2
    models._config_of.cache_clear()
