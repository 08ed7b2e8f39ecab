"""`kvbackend demo`: the recommended spec and two reference points serving the shipped model through
the paged cache, beside the exact cache.

The default prompt is a long document (the start of Python's own ``argparse`` module, present wherever
Python is) with a question, so its first 2048-token chunk is packed as an engine would pack it. For
each cache the demo generates greedily (the text a user sees) and then teacher-forces the exact run's
tokens to measure how often the cache picks the same next token and the KL of its next-token
distribution against the exact one: greedy texts part at the first differing token, so counting
equal positions after that says little.
"""

from __future__ import annotations

import argparse as argparse_module
import time
from dataclasses import dataclass

import torch

from kvbackend.spec import RECOMMENDED_SPEC
from kvbackend.tools.models import cache_argument

# The recommended spec and at most two reference points: KIVI-2 (the usual 2-bit baseline) and FP8.
DEFAULT_CODECS = (RECOMMENDED_SPEC, "kivi:bits=2,group=32", "fp8")
DOCUMENT_TOKENS = 2300  # of the document: more than one 2048-token chunk, so one chunk is packed
QUESTION = "What does the code above do? Answer in two sentences."
PAGE_SIZE = 64


@dataclass
class DemoRun:
    codec: str
    tokens: torch.Tensor  # [B, new] generated ids (greedy)
    seconds: float
    stored_bytes: int
    exact_bytes: int
    packed_tokens: int  # per batch, all rows: tokens held in packed pages after generation
    logits: torch.Tensor  # [B, new, V] teacher-forced along the exact run's tokens


def default_prompt(tokenizer) -> str:
    """The start of ``argparse.py`` (about DOCUMENT_TOKENS tokens) followed by QUESTION."""
    with open(argparse_module.__file__, encoding="utf-8") as f:
        source = f.read()
    ids = tokenizer(source).input_ids[:DOCUMENT_TOKENS]
    return "```python\n" + tokenizer.decode(ids) + "\n```\n\n" + QUESTION


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
                             pad_token_id=model.config.pad_token_id, **cache_argument(model, cache))
    return out[:, batch["input_ids"].shape[1] :], time.perf_counter() - start


def _teacher_forced(model, batch, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, new, V] of each next token, the prompt and ``tokens[:, :-1]`` fed through ``cache``."""
    mask = batch["attention_mask"]
    with torch.no_grad():
        first = model(batch["input_ids"], attention_mask=mask, use_cache=True,
                      **cache_argument(model, cache)).logits[:, -1:]
        if tokens.shape[1] == 1:
            return first.float()
        mask = torch.cat([mask, torch.ones_like(tokens[:, :-1])], dim=1)
        rest = model(tokens[:, :-1], attention_mask=mask, use_cache=True, **cache_argument(model, cache)).logits
    return torch.cat([first, rest], dim=1).float()


@dataclass(frozen=True)
class Agreement:
    top1: float  # share of positions where the cache's next token is the exact cache's
    kl: float  # mean KL(exact || cache) of the next-token distributions
    leading_equal: list[int]  # per row: greedy tokens equal to the exact run's before they part


def agreement(run: DemoRun, exact: DemoRun) -> Agreement:
    """How closely ``run`` follows ``exact`` (teacher-forced along the exact run's tokens)."""
    reference, got = exact.logits.log_softmax(-1), run.logits.log_softmax(-1)
    top1 = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
    kl = float((reference.exp() * (reference - got)).sum(-1).mean())
    same = (run.tokens == exact.tokens).int().cumprod(dim=1).sum(dim=1)
    return Agreement(top1, kl, [int(x) for x in same])


def demo_runs(model, batch, codecs_to_run, max_new_tokens: int, chunk_pages: int, progress=None) -> list[DemoRun]:
    """The exact run first, then one run per codec spec, each through a `KVBackendCache`."""
    from transformers import DynamicCache

    from kvbackend.integration.transformers import KVBackendCache

    max_tokens = batch["input_ids"].shape[1] + max_new_tokens + PAGE_SIZE
    advance = (lambda: None) if progress is None else progress
    exact_cache = DynamicCache(config=model.config)
    tokens, seconds = _generate(model, batch, exact_cache, max_new_tokens)
    exact_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in exact_cache.layers)
    advance()
    logits = _teacher_forced(model, batch, DynamicCache(config=model.config), tokens)
    runs = [DemoRun("exact (DynamicCache)", tokens, seconds, exact_bytes, exact_bytes, 0, logits)]
    advance()
    for spec in codecs_to_run:
        make = lambda: KVBackendCache(model.config, codec=spec, page_size=PAGE_SIZE,  # noqa: E731
                                      chunk_pages=chunk_pages, max_tokens=max_tokens)
        cache = make()
        cache.attach(model)  # query-aware codecs read the queries; harmless for the others
        try:
            tokens, seconds = _generate(model, batch, cache, max_new_tokens)
        finally:
            cache.detach(model)
        held, packed = cache.kv_bytes(), cache.engine.stats().packed_tokens
        advance()
        forced = make()
        forced.attach(model)
        try:
            logits = _teacher_forced(model, batch, forced, runs[0].tokens)
        finally:
            forced.detach(model)
        runs.append(DemoRun(spec, tokens, seconds, held["stored"], held["exact"], packed, logits))
        advance()
    return runs


def run_demo(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvbackend.depth import check_layouts
    from kvbackend.tools.models import load_model

    console = Console(width=max(Console().width, 140))
    codecs_to_run = args.codec or list(DEFAULT_CODECS)
    from kvbackend.tools.evaluate import model_geometry

    geometry = model_geometry(args.model_dir)
    for spec in codecs_to_run:  # a bad spec, or one the model's pages cannot take, fails before the model loads
        check_layouts(spec, geometry, PAGE_SIZE)
    chunk_pages = args.chunk_pages
    with console.status("loading SmolLM2-135M-Instruct from its GGUF file"):
        model, tokenizer = load_model(model_dir=args.model_dir, device=args.device)
    prompts = args.prompt or [default_prompt(tokenizer)]
    batch = _encode_prompts(tokenizer, prompts).to(args.device)
    prompt_tokens = batch["input_ids"].shape[1]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generating, then teacher-forcing", total=2 * (len(codecs_to_run) + 1))
        runs = demo_runs(model, batch, codecs_to_run, args.max_new_tokens, chunk_pages,
                         lambda: progress.advance(task))

    exact = runs[0]
    title = (f"{len(prompts)} prompt(s) of {prompt_tokens} tokens (padded), {args.max_new_tokens} new tokens, greedy; "
             f"pages of {PAGE_SIZE} tokens, chunks of {PAGE_SIZE * chunk_pages} (a chunk is packed once full); "
             f"exact = the model's float32 K/V")
    caption = ("agree: share of next tokens equal to the exact cache's, teacher-forced along the exact run; "
               "KL: mean KL(exact || cache) of the next-token distributions; lead: greedy tokens equal to the "
               "exact run's before the texts part (per prompt)")
    summary = Table(title=title, caption=caption)
    for col in ("cache", "packed", "KV bytes exact", "KV bytes stored", "compression", "tokens/s",
                "agree", "KL", "lead"):
        summary.add_column(col, justify="left" if col == "cache" else "right")
    for run in runs:
        fit = agreement(run, exact)
        summary.add_row(run.codec, f"{run.packed_tokens // len(prompts):,}", f"{run.exact_bytes:,}",
                        f"{run.stored_bytes:,}", f"{run.exact_bytes / max(run.stored_bytes, 1):.2f}x",
                        f"{run.tokens.numel() / run.seconds:.1f}", f"{fit.top1:.1%}", f"{fit.kl:.4f}",
                        " / ".join(str(x) for x in fit.leading_equal))
    console.print(summary)
    if prompt_tokens < PAGE_SIZE * chunk_pages:
        console.print(f"[yellow]The prompt is shorter than a chunk ({PAGE_SIZE * chunk_pages} tokens): nothing but "
                      f"whole chunks is compressed, so these caches hold it exact. Pass a longer prompt or "
                      f"--chunk-pages N.[/yellow]")
    texts = Table(title="generated text", show_lines=True)
    texts.add_column("prompt", max_width=24)
    for run in runs:
        texts.add_column(run.codec, overflow="fold")
    for i, prompt in enumerate(prompts):
        shown = prompt if len(prompt) <= 60 else "…" + prompt[-60:]
        texts.add_row(shown, *(tokenizer.decode(run.tokens[i], skip_special_tokens=True).strip() for run in runs))
    console.print(texts)
    return 0
