"""End-to-end serving benchmark: how many long requests fit, and how fast they decode, per cache.

    python perf/bench_serving.py --out perf/results/bench_serving.json --plot perf/results/bench_serving.png
    python perf/bench_serving.py --tiny --out /tmp/serving.json      # a CPU smoke run of every section

A Llama-architecture model with random weights (Llama-3-8B geometry in BF16 on CUDA; a small one with
``--tiny``) runs through the API a serving engine uses: `KVCache` page tables, `plan`/`decode`/`gather`
and `append`/`append_step` (`kvbackend.tools.llama_runner`). Per cache (BF16 pages, rtn-2, the
recommended spec; ``--caches``), in one run:

1. capacity: one request of ``--context`` tokens is filled and the bytes it holds are measured (packed
   pages of every layer, its codebook slots, and one dense chunk for the active tail); the budget
   (``--budget-gib``) divided by that is the number of such requests that fit at once;
2. decode throughput: ``--steps`` greedy decode steps of a batch of requests holding ``--context``
   tokens each, at several concurrencies up to the cache's capacity (``--max-batch`` caps it) and at
   BF16's capacity (equal concurrency); tokens/s and time per output token. The requests' K/V are
   random (decode speed does not depend on the values); request 0 is encoded once and its packed pages
   are installed as copies for the others (the tiers' restore path), so every request has pages of
   its own in memory;
3. a continuous-batching workload: ``--workload`` requests with prompts of ``--prompt-min`` to
   ``--prompt-max`` tokens (a share of them with a common prefix), arriving ``--arrival-steps`` engine
   steps apart; each engine step admits what fits, prefills one ``--prefill-chunk`` of the oldest
   prompt and decodes one token of every running request; time to first token, time per output token
   and output tokens/s;
4. time to first token of a ``--context``-token prompt: computed from scratch (chunked prefill), and
   with its packed pages offloaded to the host tier, or to the file tier, and restored on admission
   (`TieredCache.add_request`) before the rest is prefilled.

Prints one table of the headline ratios, writes every figure as JSON and throughput against
concurrency as a PNG. As the outside anchor, transformers' own continuous batching (`generate_batch`,
where the installed version has it) runs the workload's prompts (all at once: it takes no arrivals).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.rope import rotary_from_config
from kvbackend.spec import RECOMMENDED_PAGE_SPEC
from kvbackend.tools.llama_runner import LlamaRunner

CACHES = ("identity", "rtn:bits=2,group=64", RECOMMENDED_PAGE_SPEC)


@dataclass
class Shape:
    """The model and workload sizes of one run."""

    context: int  # tokens each request holds in the capacity and throughput sections
    budget_bytes: int
    page_size: int
    chunk_pages: int
    max_batch: int
    steps: int
    prompt_min: int
    prompt_max: int
    prefill_chunk: int
    workload: int
    new_tokens: int
    arrival_steps: int  # engine steps between two arrivals


def llama(tiny: bool, device: str, dtype: torch.dtype, max_tokens: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, num_hidden_layers=2, vocab_size=512)
    else:  # Llama-3-8B
        sizes = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, num_hidden_layers=32, vocab_size=128256)
    config = LlamaConfig(**sizes, max_position_embeddings=2 * max_tokens, rope_theta=500000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Give the pools of a cache that went out of scope back (caches hold reference cycles)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def make_cache(model, codec: str, shape: Shape, requests: int, tokens: int, device: str) -> KVCache:
    """A cache whose pools hold ``requests`` requests of ``tokens`` tokens (each with a dense chunk)."""
    config = model.config
    geometry = Geometry(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, model.dtype)
    pages = -(-tokens // shape.page_size) + 1
    cfg = CacheConfig(codec=codec, page_size=shape.page_size, chunk_pages=shape.chunk_pages,
                      dense_pages=requests * (shape.chunk_pages + 2), packed_pages=requests * pages + shape.chunk_pages,
                      device=device, check_finite=False)
    return KVCache(geometry, cfg, rotary=rotary_from_config(config))


def fill_random(cache: KVCache, rid: int, tokens: int, seed: int, query_heads: int) -> None:
    """Append ``tokens`` random K/V (with ``query_heads`` queries per token, for query-aware codecs) to
    every layer, chunk by chunk."""
    g = cache.geometry
    gen = torch.Generator(device=cache.dense.data.device).manual_seed(seed)
    step = cache.config.chunk_tokens
    hq = query_heads
    for start in range(cache.page_table(rid).lengths[0], tokens, step):
        n = min(step, tokens - start)
        for layer in range(g.num_layers):
            kv = torch.randn(2, n, g.num_kv_heads, g.head_dim, generator=gen, device=gen.device).to(g.dtype)
            q = (torch.randn(n, hq, g.head_dim, generator=gen, device=gen.device).to(g.dtype)
                 if cache.codecs[layer].uses_queries else None)
            cache.append(rid, layer, kv[0], kv[1], queries=q)


def held_bytes(cache: KVCache, rid: int) -> dict:
    """Bytes one request holds: its packed pages in every layer, the codebook slots they use, and a
    whole dense chunk (the active tail, at most one chunk)."""
    table = cache.page_table(rid)
    packed = sum(layout.page_bytes for layout in cache.layouts) * len(table.packed)
    slots = {cache.packed.slot_of_page[page] for page in table.packed}
    books = sum(layout.codebook_bytes for layout in cache.layouts) * len(slots)
    dense_page = cache.dense.data[:, 0].numel() * cache.dense.data.element_size()  # one page, every layer
    dense = dense_page * cache.config.chunk_pages
    return {"packed": packed, "codebooks": books, "dense_chunk": dense, "total": packed + books + dense}


def requests_like(cache: KVCache, source: int, count: int, tokens: int, seed: int, query_heads: int) -> list[int]:
    """``count`` requests holding ``tokens`` tokens each: request ``source``'s packed pages installed as
    copies under other token ids (distinct physical pages, the bytes encoded once), the tail appended.

    A page group's trailer names the key of the prompt it was encoded for, and `install_pages` refuses
    it under any other key; here each copy's trailer is rewritten to the new prompt's key and a chunk id
    of its own (so each copy also opens codebook slots of its own), which is what a restore of that
    prompt's own pages would hold."""
    group = cache.group
    exported = [cache.export_page(page) for page in cache.page_table(source).packed]
    blobs = torch.zeros(len(exported), cache.blob_bytes, dtype=torch.uint8, device=exported[0].device)
    for row, blob in zip(blobs, exported):  # rows of the largest group's size, as the tiers store them
        row[: blob.numel()] = blob
    span = slice(group.pages_bytes, group.books_offset)
    heads = blobs[:, span].cpu().numpy()
    trailers = [group.unpack_trailer(bytes(h)) for h in heads]
    rng = random.Random(seed)
    vocab = 1 << 20
    ids = []
    for i in range(count):
        token_ids = [rng.randrange(vocab) for _ in range(tokens)]
        keys = cache.prefix_keys(token_ids)[: blobs.shape[0]]
        for row, (key, t) in enumerate(zip(keys, trailers)):
            raw = group.pack_trailer(key, t.chunk_id ^ ((seed + i + 1) << 32), t.carries_codebook)
            blobs[row, span] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(blobs.device)
        cache.install_pages(keys, token_ids, blobs[: len(keys)], 0)
        rid, hit = cache.add_request(token_ids)
        if hit < len(keys) * cache.config.page_size:
            raise RuntimeError(f"installed copies of {len(keys)} pages, add_request found {hit} tokens")
        fill_random(cache, rid, tokens, seed + i + 1, query_heads)
        ids.append(rid)
    return ids


def timed_steps(runner: LlamaRunner, ids: list[int], tokens: torch.Tensor, steps: int, device: str,
                warm: int = 1):
    """``steps`` greedy decode steps after ``warm`` untimed ones (kernels compile, graphs are captured): the sorted
    step times in seconds and the last step's tokens."""
    for _ in range(warm):
        tokens = runner.decode(ids, tokens).argmax(-1)
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = runner.decode(ids, tokens).argmax(-1)
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times), tokens


def decode_rate(runner: LlamaRunner, ids: list[int], steps: int, device: str, graphs: bool = False) -> dict:
    """Greedy decode steps of the batch ``ids`` (eager; on CUDA also the step's kernel time and, with ``graphs``,
    the same steps with the model's work replayed as CUDA graphs)."""
    times, tokens = timed_steps(runner, ids, torch.zeros(len(ids), dtype=torch.long), steps, device)
    median = times[len(times) // 2]
    row = {"batch": len(ids), "step_ms_median": median * 1e3, "step_ms_max": times[-1] * 1e3,
           "tokens_per_s": len(ids) / median}
    if device == "cuda":  # the step's kernels alone: what bounds an engine whose steps are not bound by the host
        kernel_ms = step_kernel_ms(runner, ids, tokens)
        row.update(kernel_ms=kernel_ms, kernel_bound_tokens_per_s=len(ids) / (kernel_ms / 1e3))
        if graphs:
            times, _ = timed_steps(LlamaRunner(runner.model, runner.cache, cuda_graphs=True), ids, tokens, steps,
                                   device, warm=2)  # (the capture, then one replay)
            median = times[len(times) // 2]
            row.update(graph_step_ms_median=median * 1e3, graph_tokens_per_s=len(ids) / median)
    return row


def step_kernel_ms(runner: LlamaRunner, ids: list[int], tokens: torch.Tensor) -> float:
    """The summed time of the kernels one decode step runs (one stream: they run one after another), from the
    profiler's device events: a lower bound of the step's time, which an engine that replays its steps as CUDA
    graphs approaches (the eager step of this bench is bound by the host at small batches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode(ids, tokens)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA) / 1e3


def capacity_and_throughput(model, codec: str, shape: Shape, batches: list[int], device: str,
                            graphs: bool = False) -> dict:
    """Sections 1 and 2 for one cache."""
    probe = make_cache(model, codec, shape, 1, shape.context, device)
    rid, _ = probe.add_request(list(range(shape.context)))
    t0 = time.perf_counter()
    heads = model.config.num_attention_heads
    fill_random(probe, rid, shape.context, 0, heads)
    sync(device)
    fill_s = time.perf_counter() - t0
    held = held_bytes(probe, rid)
    capacity = shape.budget_bytes // held["total"]
    del probe
    release(device)
    rows = []
    limit = min(capacity, shape.max_batch)
    for batch in sorted({b for b in batches if 0 < b <= limit} | ({limit} if limit else set())):
        cache = make_cache(model, codec, shape, batch, shape.context + 2 * shape.steps + 5, device)
        first, _ = cache.add_request(list(range(shape.context)))
        fill_random(cache, first, shape.context, 0, heads)
        ids = [first] + requests_like(cache, first, batch - 1, shape.context, 1000, heads)
        rows.append(decode_rate(LlamaRunner(model, cache), ids, shape.steps, device, graphs))
        del cache
        release(device)
    return {"codec": codec, "bytes_per_request": held, "capacity": int(capacity), "encode_fill_s": fill_s,
            "decode": rows}


def prefill_all(runner: LlamaRunner, rid: int, prompt: list[int], chunk: int, device: str) -> int:
    """Prefill what the request does not hold yet; returns the first output token (synchronised)."""
    start = runner.cache.page_table(rid).lengths[0]
    logits = None
    for begin in range(start, len(prompt), chunk):
        logits = runner.prefill(rid, torch.tensor(prompt[begin:begin + chunk]))
    token = int(logits.argmax())
    sync(device)
    return token


def warm_up(runner: LlamaRunner, shape: Shape, device: str) -> None:
    """An untimed request of two prefill chunks (its own tokens: no prefix shared with what is timed), freed: the
    kernels a prefill after cached tokens runs are compiled (or loaded) before any clock starts."""
    prompt = [random.Random(5).randrange(1, runner.model.config.vocab_size) for _ in range(2 * shape.prefill_chunk)]
    rid, _ = runner.cache.add_request(prompt)
    prefill_all(runner, rid, prompt, shape.prefill_chunk, device)
    runner.cache.free(rid)


def first_token_times(model, codec: str, shape: Shape, device: str, directory: str) -> dict:
    """Section 4: time to first token of a ``context``-token prompt computed from scratch, and with its
    prefix restored from the host tier and from the file tier (every packed page offloaded first; the
    file read is served by the OS page cache when it holds the file). ``*_same_first_token``: the
    restored run's first token is the recomputed one (always so for lossless pages; a lossy codec may
    differ, since from scratch the prompt's last chunk was still exact when its first token came)."""
    from kvbackend.tiers.file import FileTier
    from kvbackend.tiers.host import HostTier
    from kvbackend.tiers.prefetch import TieredCache

    cache = make_cache(model, codec, shape, 2, shape.context + 2, device)
    runner = LlamaRunner(model, cache)
    prompt = [random.Random(11).randrange(1, model.config.vocab_size) for _ in range(shape.context)]
    warm_up(runner, shape, device)
    t0 = time.perf_counter()
    rid, _ = cache.add_request(prompt)
    want = prefill_all(runner, rid, prompt, shape.prefill_chunk, device)
    out = {"codec": codec, "prompt_tokens": shape.context, "recompute_s": time.perf_counter() - t0}
    cache.free(rid)
    pages = len(cache.evictable_pages())
    host = HostTier(max(2 * pages, 1) * cache.blob_bytes, cache.blob_bytes)
    file = FileTier(os.path.join(directory, codec.partition(":")[0]), 64 * pages * cache.blob_bytes + (1 << 20),
                    cache.fingerprint)
    for name, tiers in (("host", (host, None)), ("file", (None, file))):
        tiered = TieredCache(cache, *tiers, background=False)
        moved = tiered.offload(max_pages=len(cache.evictable_pages()))
        tiered.flush()
        t0 = time.perf_counter()
        rid, hit = tiered.add_request(prompt)
        token = prefill_all(runner, rid, prompt, shape.prefill_chunk, device)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_restored_tokens"] = hit
        out[f"{name}_pages_moved"] = moved
        out[f"{name}_same_first_token"] = token == want
        tiered.free(rid)
        tiered.close()
    host.close()
    file.close()
    del cache, runner
    release(device)
    return out


@dataclass
class Request:
    rid: int | None
    prompt: list[int]
    arrival: int  # engine step
    done_prompt: int = 0
    cached: int = 0  # prompt tokens found in the cache (a shared prefix)
    output: list[int] = field(default_factory=list)
    first_token_s: float = 0.0
    arrived_s: float | None = None
    finished_s: float | None = None


def workload(shape: Shape, seed: int, vocab: int) -> list[Request]:
    """Prompts of prompt_min..prompt_max tokens, half of them opening with one shared prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(shape.prompt_min // 2)]
    out = []
    for i in range(shape.workload):
        n = rng.randrange(shape.prompt_min, shape.prompt_max + 1)
        head = shared if i % 2 else []
        out.append(Request(None, head + [rng.randrange(1, vocab) for _ in range(n - len(head))],
                           i * shape.arrival_steps))
    return out


def serve(model, codec: str, shape: Shape, device: str, held: dict) -> dict:
    """Section 3: continuous batching over a cache sized to the budget (``held``: the bytes a
    ``context``-token request holds, from section 1)."""
    per_token = held["total"] / shape.context
    longest = shape.prompt_max + shape.new_tokens
    slots = max(1, min(shape.max_batch, int(shape.budget_bytes // (per_token * longest))))
    cache = make_cache(model, codec, shape, slots, longest, device)
    runner = LlamaRunner(model, cache)
    warm_up(runner, shape, device)
    pending, running, finished = workload(shape, 7, model.config.vocab_size), [], []
    step, began = 0, time.perf_counter()
    while pending or running:
        now = time.perf_counter() - began
        for req in pending:  # time to first token counts from arrival, waiting for a slot included
            if req.arrival <= step and req.arrived_s is None:
                req.arrived_s = now
        while pending and pending[0].arrival <= step and len(running) < slots:
            req = pending.pop(0)
            req.rid, req.cached = cache.add_request(req.prompt)
            req.done_prompt = cache.page_table(req.rid).lengths[0]  # a shared prefix is already there
            running.append(req)
        prefilling = [r for r in running if r.done_prompt < len(r.prompt)]
        if prefilling:  # one chunk of the oldest prompt per engine step
            req = prefilling[0]
            end = min(len(req.prompt), req.done_prompt + shape.prefill_chunk)
            logits = runner.prefill(req.rid, torch.tensor(req.prompt[req.done_prompt:end]))
            req.done_prompt = end
            if end == len(req.prompt):
                sync(device)
                req.output.append(int(logits.argmax()))
                req.first_token_s = time.perf_counter() - began
        decoding = [r for r in running if r.done_prompt == len(r.prompt) and r.output and
                    len(r.output) < shape.new_tokens]
        if decoding:
            # the pools hold every admitted request at its longest: CacheFull here would be a bug
            logits = runner.decode([r.rid for r in decoding], torch.tensor([r.output[-1] for r in decoding]))
            for r, token in zip(decoding, logits.argmax(-1).tolist()):
                r.output.append(token)
        sync(device)
        t = time.perf_counter() - began
        for r in [r for r in running if len(r.output) >= shape.new_tokens]:
            r.finished_s = t
            running.remove(r)
            cache.free(r.rid)
            finished.append(r)
        step += 1
        if not running and pending:
            step = max(step, pending[0].arrival)
    total = time.perf_counter() - began
    del cache, runner
    release(device)
    ttft = sorted(r.first_token_s - r.arrived_s for r in finished)
    tpot = sorted((r.finished_s - r.first_token_s) / max(len(r.output) - 1, 1) for r in finished)
    return {"codec": codec, "slots": slots, "requests": len(finished), "engine_steps": step, "wall_s": total,
            "output_tokens": sum(len(r.output) for r in finished), "prompt_tokens_reused": sum(r.cached for r in finished),
            "output_tokens_per_s": sum(len(r.output) for r in finished) / total,
            "ttft_s_median": ttft[len(ttft) // 2], "tpot_ms_median": tpot[len(tpot) // 2] * 1e3}


def drift(first: dict | None, again: dict | None) -> str:
    """A line on the baseline's own drift: its row at its limit measured again after the other caches, each rate
    against the first measurement (every ratio of the tables is against the first; the drift says how far the
    machine itself moved between the two)."""
    if not first or not again:
        return ""
    parts = [f"{what} {again[key]:.1f} against {first[key]:.1f} ({again[key] / first[key] - 1:+.1%})"
             for key, what in (("tokens_per_s", "eager"), ("graph_tokens_per_s", "with CUDA graphs"),
                               ("kernel_bound_tokens_per_s", "kernel-bound"))
             if first.get(key) and again.get(key)]
    return f"The first cache at its limit (B={again['batch']}) measured again after the others, tokens/s: " \
        + "; ".join(parts) + "."


def headline(results: list[dict], budget_gib: float, context: int) -> str:
    """One Markdown table of the ratios against the first cache (the baseline)."""
    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    def at(r, batch):
        return next((d for d in r["decode"] if d["batch"] == batch), None)

    base = results[0]
    base_top = base["decode"][-1] if base["decode"] else None
    lines = [f"| cache | {context}-token requests in {budget_gib:g} GiB | vs first | decode tokens/s at its limit "
             "| vs first at its limit | tokens/s at the first's limit | vs first |", "|---|---|---|---|---|---|---|"]
    for r in results:
        top = r["decode"][-1] if r["decode"] else None
        same = at(r, base_top["batch"]) if base_top else None
        lines.append(" | ".join([
            f"| {r['codec']}", str(r["capacity"]), ratio(r["capacity"], base["capacity"]),
            f"{top['tokens_per_s']:.1f} (B={top['batch']})" if top else "-",
            ratio(top and top["tokens_per_s"], base_top and base_top["tokens_per_s"]),
            f"{same['tokens_per_s']:.1f}" if same else "-",
            ratio(same and same["tokens_per_s"], base_top and base_top["tokens_per_s"])]) + " |")
    for time_key, rate_key, what in (
            ("graph_step_ms_median", "graph_tokens_per_s", "step with CUDA graphs"),
            # B / the summed kernel time of one step: what an engine whose steps are not bound by the host approaches
            ("kernel_ms", "kernel_bound_tokens_per_s", "kernel time of a step")):
        if not base_top or rate_key not in base_top:  # (CUDA) the same rows, with graphs, and bound by their kernels
            continue
        lines += ["", f"| cache | {what} at its limit | tokens/s | vs first | tokens/s at the first's limit "
                  "| vs first |", "|---|---|---|---|---|---|"]
        for r in results:
            top = r["decode"][-1] if r["decode"] else None
            same = at(r, base_top["batch"])
            lines.append(" | ".join([
                f"| {r['codec']}", f"{top[time_key]:.1f} ms (B={top['batch']})" if top else "-",
                f"{top[rate_key]:.1f}" if top else "-", ratio(top and top[rate_key], base_top[rate_key]),
                f"{same[rate_key]:.1f}" if same else "-", ratio(same and same[rate_key], base_top[rate_key])]) + " |")
    return "\n".join(lines)


def generate_batch_anchor(model, shape: Shape, device: str) -> dict:
    """transformers' own continuous batching (`generate_batch`, its paged BF16 cache) on the workload's
    prompts, all submitted at once (it takes no arrival times), greedy, ``new_tokens`` each."""
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        return {"measured": False, "why": "this transformers has no generate_batch"}
    prompts = [r.prompt for r in workload(shape, 7, model.config.vocab_size)]
    config = GenerationConfig(max_new_tokens=shape.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:  # one small untimed call first, as the caches above run with their kernels compiled
        model.generate_batch([p[:64] for p in prompts[:2]], generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0))
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=config)
        sync(device)
        wall = time.perf_counter() - t0
    except Exception as error:  # noqa: BLE001 - reported, not hidden: its API moves between releases
        return {"measured": False, "why": f"{type(error).__name__}: {str(error)[:300]}"}
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"measured": True, "requests": len(out), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall}


def workload_table(served: list[dict], anchor: dict | None) -> str:
    lines = ["| workload | output tokens/s | time to first token (median) | time per output token (median) |",
             "|---|---|---|---|"]
    for r in served:
        lines.append(f"| {r['codec']} | {r['output_tokens_per_s']:.1f} | {r['ttft_s_median'] * 1e3:.1f} ms | "
                     f"{r['tpot_ms_median']:.1f} ms |")
    if anchor is not None:
        rate = f"{anchor['output_tokens_per_s']:.1f}" if anchor["measured"] else f"not measured ({anchor['why'][:60]})"
        lines.append(f"| transformers generate_batch (all prompts at once) | {rate} | - | - |")
    return "\n".join(lines)


def ttft_table(rows: list[dict]) -> str:
    """Time to first token of a prompt recomputed and restored, per cache; ratios against recomputing
    and against the first cache's restores (raw pages when the first is ``identity``)."""
    base = rows[0]
    lines = [f"| cache | recompute {base['prompt_tokens']} tokens | from host | x faster than recompute | "
             "vs first's host | from file | x faster than recompute | vs first's file |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['recompute_s'] * 1e3:.1f} ms | {r['host_s'] * 1e3:.1f} ms | "
                     f"{r['recompute_s'] / r['host_s']:.2f}x | {base['host_s'] / r['host_s']:.2f}x | "
                     f"{r['file_s'] * 1e3:.1f} ms | {r['recompute_s'] / r['file_s']:.2f}x | "
                     f"{base['file_s'] / r['file_s']:.2f}x |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r["decode"]:
            line, = ax.plot([d["batch"] for d in r["decode"]], [d["tokens_per_s"] for d in r["decode"]], marker="o",
                            label=f"{r['codec'][:40]} (fits {r['capacity']})")
            graphed = [d for d in r["decode"] if "graph_tokens_per_s" in d]
            if graphed:
                ax.plot([d["batch"] for d in graphed], [d["graph_tokens_per_s"] for d in graphed], marker="s",
                        linestyle="--", color=line.get_color(), label=f"{r['codec'][:40]}, CUDA graphs")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", default="|".join(CACHES), help="codec specs separated by |; the first is the baseline")
    parser.add_argument("--tiny", action="store_true", help="a small model and short contexts (CPU smoke run)")
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--context", type=int, default=32768, help="tokens per request (capacity, throughput)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--batches", default="1,4,16", help="concurrencies measured besides each cache's limit")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per concurrency")
    parser.add_argument("--workload", type=int, default=8, help="requests in the continuous-batching run (0: skip)")
    parser.add_argument("--prompt-min", type=int, default=8192)
    parser.add_argument("--prompt-max", type=int, default=16384)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--arrival-steps", type=int, default=4, help="engine steps between two arrivals")
    parser.add_argument("--graphs", type=int, default=1,
                        help="1: on CUDA also time the decode steps with the model's work as CUDA graphs")
    parser.add_argument("--anchor", type=int, default=1,
                        help="1: also run transformers' generate_batch on the workload's prompts")
    parser.add_argument("--baseline-again", type=int, default=1,
                        help="1: measure the first cache at its limit again after the others (the machine's drift)")
    parser.add_argument("--ttft", type=int, default=1, help="1: time to first token from the tiers (section 4)")
    parser.add_argument("--tier-dir", default=None, help="where the file tier writes (default: the system's temp dir)")
    parser.add_argument("--out", default="perf/results/bench_serving.json")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.context, args.prompt_min, args.prompt_max, args.prefill_chunk = 512, 150, 300, 100
        args.budget_gib, args.max_batch, args.steps, args.new_tokens = min(args.budget_gib, 0.01), 8, 2, 4
        args.workload = min(args.workload, 4)
    page_size, chunk_pages = (64, 2) if args.tiny else (64, 32)
    shape = Shape(args.context, int(args.budget_gib * 2**30), page_size, chunk_pages, args.max_batch, args.steps,
                  args.prompt_min, args.prompt_max, args.prefill_chunk, args.workload, args.new_tokens,
                  args.arrival_steps)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = llama(args.tiny, device, dtype, max(args.context, args.prompt_max) + args.new_tokens + args.steps + 8)
    caches = args.caches.split("|")
    results = []
    base_capacity = None
    for codec in caches:
        batches = [int(b) for b in args.batches.split(",") if b]
        if base_capacity is not None:
            batches.append(min(base_capacity, args.max_batch))  # equal concurrency with the baseline
        r = capacity_and_throughput(model, codec, shape, batches, device, bool(args.graphs))  # and at its limit
        if base_capacity is None:
            base_capacity = r["capacity"]
        print(json.dumps(r), flush=True)
        results.append(r)
    again = None
    if len(results) > 1 and args.baseline_again:  # the baseline's limit once more: how far the machine moved
        rows = capacity_and_throughput(model, caches[0], shape, [], device, bool(args.graphs))["decode"]
        again = rows[-1] if rows else None  # (none where the baseline holds no request in the budget)
        print(json.dumps({"baseline_again": again}), flush=True)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": asdict(shape),
           "caches": results, "baseline_again": again, "workload": [], "generate_batch": None, "first_token": [],
           "headline": None}

    def save() -> None:  # after every section, so a run cut short keeps what it measured
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    save()
    if args.plot:
        plot(results, args.plot)
    served = out["workload"]
    for r in results if shape.workload else []:
        served.append(serve(model, r["codec"], shape, device, r["bytes_per_request"]))
        print(json.dumps(served[-1]), flush=True)
        save()
    first = out["first_token"]
    if args.ttft:
        with tempfile.TemporaryDirectory(dir=args.tier_dir) as directory:
            for codec in caches:
                first.append(first_token_times(model, codec, shape, device, directory))
                print(json.dumps(first[-1]), flush=True)
                save()
    anchor = generate_batch_anchor(model, shape, device) if shape.workload and args.anchor else None
    if anchor is not None:
        out["generate_batch"] = anchor
        print(json.dumps({"generate_batch": anchor}), flush=True)
    table = headline(results, args.budget_gib, shape.context)
    line = drift(results[0]["decode"][-1] if results[0]["decode"] else None, again)
    if line:
        table += "\n\n" + line
    if served:
        table += "\n\n" + workload_table(served, anchor)
    if first:
        table += "\n\n" + ttft_table(first)
    print(table, flush=True)
    out["headline"] = table
    save()


if __name__ == "__main__":
    main()
