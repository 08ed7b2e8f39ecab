"""The same spec over several k-means seeds: `kvbackend eval --seeds N`.

Codecs that cluster (qvg, quantwm, and ``auto:`` plans over them) draw their first centroids at random; one seed's
KL can sit 1.4x from another's on the same text (perf/NOTES.md, eval49), so a single run says little below that.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvbackend import codecs
from kvbackend.alignpred.spec import is_alignpred
from kvbackend.depth import parse_depth
from kvbackend.errors import SpecError
from kvbackend.spec import split_spec
from kvbackend.tools.auto import parse_auto


def seeded(spec: str, seed: int) -> str | None:
    """``spec`` with its k-means seed set to ``seed`` (an ``auto:`` plan's base's), or None for a codec that
    draws no seed (its results do not depend on one)."""
    if is_alignpred(spec):
        return None
    name, options = split_spec(spec)
    if name in ("auto", "depth"):
        base = seeded(parse_auto(spec).base if name == "auto" else parse_depth(spec).base, seed)
        if base is None:
            return None
        options["base"] = base.replace(",", ";")  # a nested spec's commas are written as ';'
    else:
        try:
            parsed = codecs.parse(spec)
        except SpecError:
            return None
        if not hasattr(parsed, "seed"):
            return None
        options["seed"] = str(seed)
    return f"{name}:" + ",".join(f"{key}={value}" for key, value in options.items())


def expand(specs: list[str], seeds: int) -> list[tuple[str, str]]:
    """(spec as given, spec run) pairs: each seeded spec ``seeds`` times (seeds 0..seeds-1), the others once."""
    if seeds < 1:
        raise ValueError(f"seeds must be at least 1, got {seeds}")
    runs = []
    for spec in specs:
        variants = [seeded(spec, s) for s in range(seeds)] if seeds > 1 else [None]
        runs += [(spec, spec)] if variants[0] is None else [(spec, v) for v in variants]
    return runs


@dataclass
class SeedSummary:
    """One spec's figures over its seeds: mean, smallest and largest."""

    spec: str
    runs: int
    bpv: float  # mean (the bytes hardly move with the seed)
    kl_mean: float
    kl_min: float
    kl_max: float
    top1_mean: float
    top1_min: float
    top1_max: float


def summarize(runs: list[tuple[str, str]], results: list) -> list[SeedSummary]:
    """A `SeedSummary` per spec as given, from ``results`` (one per run, in the order of ``runs``)."""
    if len(runs) != len(results):
        raise ValueError(f"{len(runs)} runs but {len(results)} results")
    out = []
    for spec in dict.fromkeys(given for given, _ in runs):
        mine = [r for (given, _), r in zip(runs, results) if given == spec]
        kl = [r.kl for r in mine]
        top1 = [r.top1_agree for r in mine]
        out.append(SeedSummary(spec, len(mine), statistics.fmean(r.bpv for r in mine), statistics.fmean(kl), min(kl),
                               max(kl), statistics.fmean(top1), min(top1), max(top1)))
    return out
