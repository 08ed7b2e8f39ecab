"""`kvbackend demo`: generate with the shipped model through compressed caches, beside the exact cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

DEFAULT_CODECS = ("fp8", "kivi:bits=4,group=16", "kivi:bits=2,group=16", "qvg:centroids=8,group=32")
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky looks blue during the day and red at sunset.",
    "Here is a short story. A lighthouse keeper lived alone on a rocky island far from the coast. Every night "
    "he climbed the stairs, lit the great lamp and watched the ships pass safely in the dark. One winter a storm "
    "broke the lamp's lens, and with no way to send for help he had to find another way to warn the ships. "
    "He gathered every lantern and mirror on the island and arranged them on the cliff. Continue the story.",
)
# Small chunks, so that most of each prompt is compressed even in a short demo.
DEMO_PAGE_SIZE = 16
DEMO_CHUNK_PAGES = 2


@dataclass
class DemoRun:
    codec: str
    tokens: torch.Tensor  # [B, new] generated ids
    seconds: float
    stored_bytes: int
    exact_bytes: int


def _encode_prompts(tokenizer, prompts):
    texts = []
    for prompt in prompts:
        if getattr(tokenizer, "chat_template", None):
            texts.append(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                       add_generation_prompt=True))
        else:
            texts.append(prompt)
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True)


def _generate(model, batch, cache, max_new_tokens: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             cache=cache, pad_token_id=model.config.pad_token_id)
    return out[:, batch["input_ids"].shape[1] :], time.perf_counter() - start


def run_demo(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    from transformers import DynamicCache

    from kvbackend.integration.transformers import KVBackendCache
    from kvbackend.tools.models import load_model

    console = Console(width=max(Console().width, 140))
    codecs_to_run = args.codec or list(DEFAULT_CODECS)
    from kvbackend import codecs as registry

    for spec in codecs_to_run:
        registry.parse(spec)  # a bad spec fails before the model loads
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    with console.status("loading SmolLM2-135M-Instruct from its GGUF file"):
        model, tokenizer = load_model(model_dir=args.model_dir, device=args.device)
    batch = _encode_prompts(tokenizer, prompts).to(args.device)
    runs: list[DemoRun] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generating", total=len(codecs_to_run) + 1)
        exact_cache = DynamicCache(config=model.config)
        tokens, seconds = _generate(model, batch, exact_cache, args.max_new_tokens)
        exact_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in exact_cache.layers)
        runs.append(DemoRun("exact (DynamicCache)", tokens, seconds, exact_bytes, exact_bytes))
        progress.advance(task)
        for spec in codecs_to_run:
            cache = KVBackendCache(model.config, codec=spec, page_size=DEMO_PAGE_SIZE, chunk_pages=DEMO_CHUNK_PAGES)
            tokens, seconds = _generate(model, batch, cache, args.max_new_tokens)
            held = cache.kv_bytes()
            runs.append(DemoRun(spec, tokens, seconds, held["stored"], held["exact"]))
            progress.advance(task)

    exact = runs[0].tokens
    summary = Table(title=f"{len(prompts)} prompts ({batch['input_ids'].shape[1]} tokens padded; exact = the model's float32 K/V), "
                          f"{args.max_new_tokens} new tokens each, greedy, pages of {DEMO_PAGE_SIZE}, "
                          f"chunks of {DEMO_PAGE_SIZE * DEMO_CHUNK_PAGES} tokens")
    for col in ("cache", "KV bytes exact", "KV bytes stored", "compression", "tokens/s", "same tokens as exact"):
        summary.add_column(col, justify="left" if col == "cache" else "right")
    for run in runs:
        new = run.tokens.numel()
        agree = float((run.tokens == exact).float().mean())
        summary.add_row(run.codec, f"{run.exact_bytes:,}", f"{run.stored_bytes:,}",
                        f"{run.exact_bytes / max(run.stored_bytes, 1):.2f}x", f"{new / run.seconds:.1f}", f"{agree:.1%}")
    console.print(summary)
    texts = Table(title="generated text", show_lines=True)
    texts.add_column("prompt", max_width=24)
    for run in runs:
        texts.add_column(run.codec, overflow="fold")
    for i, prompt in enumerate(prompts):
        texts.add_row(prompt[:60] + ("…" if len(prompt) > 60 else ""),
                      *(tokenizer.decode(run.tokens[i], skip_special_tokens=True).strip() for run in runs))
    console.print(texts)
    return 0
