"""`kvbackend probe`: far-away recall through a compressed cache.

Each row plants one person's passcode at the start of a long context (then ``--prefix`` tokens of a
filler text) and asks for it at the end; ``distractors`` other people's passcodes may be planted beside it.
The model answers greedily with the exact cache and with each codec through a `KVBackendCache` (the paged
cache, chunks packed as an engine packs them), one row at a time (no padding: sink tokens are the row's
own first tokens). A codec that breaks long-range recall answers differently from the exact cache even
where short-prefix KL looks fine, so the score is agreement with the exact run's answers; whether those
answers are right is reported beside it.

The default (no distractors) is a probe SmolLM2-135M passes with the exact cache (8 of 8 rows at 2048
tokens of GPL-3); with distractors it confuses people even with the exact cache (3 of 8), and agreement
then also counts which wrong passcode a confused model picks.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

NAMES = ("Alice", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiroshi", "Ines", "Jonas",
         "Kalani", "Lucia", "Mateo", "Noor", "Oskar", "Priya", "Quentin", "Rosa", "Samir", "Tamsin", "Ulrich",
         "Vera", "Wendell", "Yasmin")
ANSWER_TOKENS = 6  # greedy tokens read for an answer (4 digits and some slack)
PAGE_SIZE = 64  # tokens per page of the caches the probe builds


@dataclass(frozen=True)
class ProbeRow:
    name: str
    truth: str  # the planted passcode
    prompt: str


@dataclass(frozen=True)
class ProbeResult:
    cache: str
    answers: list[str]  # the digits each row answered ("" when none)
    agree: float  # share of rows answering as the exact cache did (1.0 for the exact cache)
    correct: float  # share of rows answering the planted passcode
    packed_tokens: int  # per row: tokens held in packed pages


def probe_rows(tokenizer, filler: str, prefix_tokens: int, questions: int, seed: int = 0,
               distractors: int = 0) -> list[ProbeRow]:
    """``questions`` prompts, each asking for the passcode of another person: that passcode (and those of
    ``distractors`` other people, in a random order) planted first, then ``prefix_tokens`` tokens of
    ``filler``, then the question.

    Raises:
        ValueError: ``questions`` outside 1..len(NAMES), ``distractors`` outside 0..questions-1, or a filler
            shorter than ``prefix_tokens`` tokens.
    """
    if not 1 <= questions <= len(NAMES):
        raise ValueError(f"questions must be in 1..{len(NAMES)}, got {questions}")
    if not 0 <= distractors < questions:
        raise ValueError(f"distractors must be in 0..{questions - 1} (other rows' people), got {distractors}")
    ids = tokenizer(filler).input_ids
    if len(ids) < prefix_tokens:
        raise ValueError(f"the filler text has {len(ids)} tokens, fewer than --prefix {prefix_tokens}")
    rng = random.Random(seed)
    names = rng.sample(NAMES, questions)
    codes = [f"{rng.randrange(1000, 10000)}" for _ in names]
    body = "\n" + tokenizer.decode(ids[:prefix_tokens]) + "\n\n"
    rows = []
    for i in range(questions):
        planted = [i] + rng.sample([j for j in range(questions) if j != i], distractors)
        rng.shuffle(planted)
        facts = "".join(f"Remember: the passcode of {names[j]} is {codes[j]}.\n" for j in planted)
        rows.append(ProbeRow(names[i], codes[i], facts + body + f"Question: what is the passcode of {names[i]}? "
                                                          f"Answer: the passcode of {names[i]} is"))
    return rows


def plan_layers(model, tokenizer, text: str, spec: str, tokens: int, page_size: int = PAGE_SIZE,
                chunk_tokens: int = 2048) -> list[str]:
    """The per-layer specs of an ``auto:bpv=B`` spec, planned as `kvbackend eval` plans them on its prefix: from
    the exact queries, keys and values of the first ``tokens`` tokens of ``text`` (the probe's filler, before
    any passcode is planted). ``auto:kl=K`` measures KL on a continuation, which the probe does not have."""
    from kvbackend.errors import SpecError
    from kvbackend.rope import rotary_from_config
    from kvbackend.tools.auto import parse_auto, plan_widths
    from kvbackend.tools.evaluate import capture_exact, geometry_from_config

    auto = parse_auto(spec)
    if auto.kl > 0:
        raise SpecError(f"{spec}: the probe takes auto:bpv=B plans; auto:kl=K needs `kvbackend eval` (it measures "
                        "the plan's KL on a continuation)")
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :tokens].to(model.device)
    exact = capture_exact(model, ids)
    geometry = geometry_from_config(model.config)
    chosen = plan_widths(auto, list(exact.q), [k.transpose(0, 1) for k in exact.k], [v.transpose(0, 1) for v in exact.v],
                         geometry, page_size, chunk_tokens, rotary_from_config(model.config))
    return list(chosen.specs)


def _answer(text: str) -> str:
    match = re.search(r"\d+", text)
    return match.group(0) if match else ""


def run_probe(model, tokenizer, rows: list[ProbeRow], codecs: list[str], chunk_pages: int = 32,
              progress=None, plans: dict[str, list[str]] | None = None) -> list[ProbeResult]:
    """The exact cache's answers first, then each codec's (through `KVBackendCache`, attached). ``plans``: the
    per-layer specs of ``auto:`` entries of ``codecs`` (`plan_layers`) and of ``klt:...,paged=true`` ones
    (`kvbackend.klt.page_specs`)."""
    from transformers import DynamicCache

    from kvbackend.integration.transformers import KVBackendCache
    from kvbackend.tools.models import cache_argument

    prompts = [tokenizer(row.prompt, return_tensors="pt").to(model.device) for row in rows]
    truths = [row.truth for row in rows]
    advance = (lambda: None) if progress is None else progress

    def answer(prompt, cache) -> str:
        length = prompt["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                 pad_token_id=model.config.pad_token_id, **cache_argument(model, cache))
        return _answer(tokenizer.decode(out[0, length:], skip_special_tokens=True))

    def score(name: str, got: list[str], exact: list[str], packed: int) -> ProbeResult:
        agree = sum(a == b for a, b in zip(got, exact)) / len(rows)
        correct = sum(a == t for a, t in zip(got, truths)) / len(rows)
        return ProbeResult(name, got, agree, correct, packed)

    exact = [answer(prompt, DynamicCache(config=model.config)) for prompt in prompts]
    advance()
    results = [score("exact (DynamicCache)", exact, exact, 0)]
    for spec in codecs:
        layers = (plans or {}).get(spec, spec)
        got, packed = [], 0
        for prompt in prompts:
            cache = KVBackendCache(model.config, codec=layers, page_size=PAGE_SIZE, chunk_pages=chunk_pages,
                                   max_tokens=prompt["input_ids"].shape[1] + 2 * PAGE_SIZE)
            cache.attach(model)
            try:
                got.append(answer(prompt, cache))
            finally:
                cache.detach(model)
            packed += cache.engine.stats().packed_tokens
        results.append(score(spec, got, exact, packed // len(rows)))
        advance()
    return results


def run_probe_cli(args) -> int:
    import json

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvbackend.depth import check_layouts
    from kvbackend.tools.models import load_model

    from kvbackend.errors import SpecError
    from kvbackend.tools.auto import parse_auto

    from kvbackend.tools.evaluate import model_geometry, prepare_output

    from kvbackend.klt import is_klt, page_specs, parse_klt

    geometry = None
    for spec in args.codec:  # a bad spec, or one the model's pages cannot take, fails before the model loads
        if is_klt(spec):
            if not parse_klt(spec).paged:
                raise SpecError(f"{spec}: the probe serves klt: through the paged cache; add axes=channels,paged=true")
            if not args.calibration:
                raise SpecError(f"{spec}: klt plans its key widths on another text: pass --calibration TEXT")
        elif parse_auto(spec) is None:
            geometry = geometry or model_geometry(args.model_dir)
            check_layouts(spec, geometry, PAGE_SIZE)
        elif parse_auto(spec).kl > 0:
            raise SpecError(f"{spec}: the probe takes auto:bpv=B plans; auto:kl=K needs `kvbackend eval`")
    with open(args.text, encoding="utf-8") as f:
        filler = f.read()
    if args.json:
        prepare_output(args.json, "--json")
    console = Console(width=max(Console().width, 120))
    with console.status("loading SmolLM2-135M-Instruct from its GGUF file"):
        model, tokenizer = load_model(model_dir=args.model_dir, device=args.device)
    rows = probe_rows(tokenizer, filler, args.prefix, args.questions, args.seed, args.distractors)
    plans = {}
    klt_specs = [spec for spec in args.codec if is_klt(spec)]
    if klt_specs:
        from kvbackend.tools.evaluate import key_bases_from_text

        with open(args.calibration, encoding="utf-8") as f:
            calib_ids = tokenizer(f.read(), return_tensors="pt").input_ids
        with console.status(f"fitting key bases on {args.calibration}"):
            bases = key_bases_from_text(model, calib_ids.to(model.device))
        for spec in klt_specs:
            plans[spec] = page_specs(parse_klt(spec), bases, PAGE_SIZE)
    for spec in args.codec:
        if parse_auto(spec) is not None:
            with console.status(f"planning {spec} on the first {args.prefix} tokens of the filler"):
                plans[spec] = plan_layers(model, tokenizer, filler, spec, args.prefix, chunk_tokens=64 * args.chunk_pages)
            console.print(f"{spec}: " + "; ".join(f"L{i}: {s}" for i, s in enumerate(plans[spec])))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("answering", total=len(args.codec) + 1)
        results = run_probe(model, tokenizer, rows, args.codec, args.chunk_pages, lambda: progress.advance(task),
                            plans)
    table = Table(title=f"recall of {len(rows)} passcodes planted before {args.prefix} tokens of {args.text}")
    for col in ("cache", "packed tokens", "agree with exact", "correct", "answers"):
        table.add_column(col, justify="left" if col in ("cache", "answers") else "right")
    for r in results:
        table.add_row(r.cache, f"{r.packed_tokens:,}", f"{r.agree:.0%}", f"{r.correct:.0%}", " ".join(a or "-" for a in r.answers))
    console.print(table)
    console.print("planted: " + " ".join(f"{row.name}={row.truth}" for row in rows))
    if results[0].correct < 0.95:
        console.print(f"[yellow]the exact cache answers only {results[0].correct:.0%} of the rows correctly: the model "
                      "does not pass this probe, so agreement also counts which wrong answer a confused model "
                      "picks (fewer --distractors, or a shorter --prefix, gives a probe it passes)[/yellow]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"text": args.text, "prefix": args.prefix, "questions": len(rows), "seed": args.seed,
                       "distractors": args.distractors,
                       "truth": [row.truth for row in rows], "results": [r.__dict__ for r in results],
                       "plans": plans}, f, indent=1)
    return 0
