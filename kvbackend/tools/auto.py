"""`auto:bpv=B` / `auto:kl=K`: choose key and value widths (and residual stages, steps and levers) per
layer, calibrated on the prompt's own prefix: the least error within a byte budget, or the fewest
bytes within a next-token KL budget.

For every layer and every point of the grid (key bits x value bits, x stages when ``stages=`` lists
several), the prefix is encoded with the base codec at those settings and attention of the prefix's
last queries is compared with the exact one (the prompt's own queries and keys: no external data):
the relative output error plus the fraction of queries whose most-attended key changes. At each grid
point the same-byte variants (``variants=``: clipped steps, pre-RoPE keys and Hadamard values on or
off) compete and the best stays. Starting from the narrowest point everywhere, the planner repeatedly
takes the one-rung widening (keys, values, stages or key outliers of one layer) with the largest error reduction
per stored byte, while the measured total stays within the budget. Deterministic for a given input.
The plan is a list of per-layer codec specs.

`auto:kl=K` walks the same greedy path without a byte limit and keeps the shortest prefix of it whose
next-token KL, measured on the prefix itself (its first part cached through the plan, its last
``calib`` tokens teacher-forced, against the exact cache), is within K (binary search on the path).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from kvbackend import codecs
from kvbackend.codecs.qvg import MAX_STAGES
from kvbackend.codecs.widths import WIDTHS
from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry
from kvbackend.levers import Levers, split_levers
from kvbackend.rope import Rotary
from kvbackend.spec import Checked, SpecKind, build_spec, format_spec, one_of, ranged, spec_kind, split_spec
from kvbackend.tools.reconstruct import reconstruct_sequence


VARIANTS = ("plain", "clip", "levers", "all")  # same-byte options tried per layer and widths (see _variants)


def _variants(kind: str, base_name: str, base_options: dict[str, str]) -> list[dict[str, str]]:
    """Option overrides of the same stored bytes tried for every table entry: clipped steps, and the
    key-frame (pre-RoPE, or page-relative when the base stores keys so) / value-rotation levers on and off."""
    clip = [{}, {"kclip": "true", "vclip": "true"} if base_name == "kivi" else {"clip": "true"}]
    frame = "pagerope" if base_options.get("pagerope", "").strip().lower() in ("1", "true", "yes", "on") else "prerope"
    levers = [{frame: pre, "vrot": rot} for pre in ("false", "true") for rot in ("none", "hadamard")]
    return {"plain": [{}], "clip": clip, "levers": levers,
            "all": [{**c, **lever} for c in clip for lever in levers]}[kind]


@dataclass(frozen=True)
class AutoSpec(Checked):
    name: str
    bpv: float = ranged(0.0, 0.0, 32.0)  # budget: bits per value over every stored byte (0: not set)
    kl: float = ranged(0.0, 0.0, 100.0)  # or: budget of next-token KL on the prefix's own tail (0: not set)
    calib: int = ranged(256, 16, 1 << 20)  # prefix tokens teacher-forced to measure the KL of a plan
    # per layer and widths also try (same bytes): "clip" (clipped steps), "levers" (pre-RoPE keys and
    # Hadamard values each on and off), "all" (both); "plain": the base as given
    variants: str = one_of("plain", VARIANTS)
    # codec whose kbits/vbits are chosen (kivi/qvg/quantwm); its own options separated by ';' in a spec string
    base: str = "kivi:group=64,sink=4,prerope=true,vrot=hadamard"
    widths: str = "2-3-4"  # candidate widths (of 2, 3, 4, 8), dash-separated
    # candidate residual stages (1..16) for qvg-family bases, dash-separated (e.g. 1-2); "": the base's
    stages: str = ""
    # candidate key outliers per page and head (quantwm bases), dash-separated (e.g. 0-16-32); "": the base's
    outliers: str = ""
    queries: int = ranged(128, 1, 1 << 20)  # last prefix queries scored per layer
    # plan per (layer, KV head) instead of per layer: a layer whose heads differ becomes a heads: spec
    # (kvbackend.codecs.heads; the torch reference serves it, the kernels do not read it)
    perhead: bool = False
    # k-means seedings each table entry is measured with (the base's seed, seed + 1, ...), errors averaged: a
    # clustering base's plan then depends less on one draw (the served specs keep the base's own seed)
    planseeds: int = ranged(1, 1, 16)


def parse_auto(text: str) -> AutoSpec | None:
    """The AutoSpec of an ``auto:...`` string, or None for any other spec."""
    name, options = split_spec(text)
    if name != "auto":
        return None
    fields = {f.name for f in dataclasses.fields(AutoSpec)} - {"name"}
    if set(options) - fields and "base" in options:  # base=kivi:group=64,sink=4: the base's options became auto's
        raise SpecError(f"unknown option(s) {', '.join(sorted(set(options) - fields))} for codec 'auto' in {text!r}; "
                        f"write the base codec's own options with ';' between them, e.g. "
                        f"base=kivi:group=64;sink=4 (valid auto options: {', '.join(sorted(fields))})")
    if "base" in options:
        options["base"] = options["base"].replace(";", ",")  # a nested spec's commas are written as ';'
    spec = build_spec(AutoSpec, name, options)
    if (spec.bpv > 0) == (spec.kl > 0):
        raise SpecError(f"auto: give exactly one positive budget, bpv=B (bits per value) or kl=K (next-token KL); "
                        f"got {text!r}")
    if is_auto(spec.base):
        raise SpecError(f"auto: base={spec.base!r} must be a codec, not another auto: spec")
    try:
        base = codecs.parse(spec.base)
    except SpecError as exc:
        raise SpecError(f"auto: base={spec.base!r}: {exc}") from None
    if not (hasattr(base, "kbits") and hasattr(base, "vbits")):
        raise SpecError(f"auto: base must be a codec with kbits/vbits options (kivi, qvg, qvg-pro, quantwm), "
                        f"got {spec.base!r}")
    _dash_list("widths", spec.widths, WIDTHS)
    if spec.stages:
        if not hasattr(base, "stages"):
            raise SpecError(f"auto: stages={spec.stages} needs a base with residual stages (qvg, qvg-pro, quantwm), "
                            f"got {spec.base!r}")
        _dash_list("stages", spec.stages, range(1, MAX_STAGES + 1))
    if spec.perhead and spec.variants != "plain":
        raise SpecError(f"auto: perhead=true plans the base's own options per head; variants={spec.variants} would let "
                        "heads of one layer pick different levers, which the cache applies per layer: use variants=plain")
    if spec.planseeds > 1 and not hasattr(base, "seed"):
        raise SpecError(f"auto: planseeds={spec.planseeds} averages over k-means seedings; the base {spec.base!r} "
                        f"draws none (use a clustering base: qvg, quantwm)")
    if spec.outliers:
        if not hasattr(base, "outliers"):
            raise SpecError(f"auto: outliers={spec.outliers} needs a base with key outliers (quantwm), got {spec.base!r}")
        _dash_list("outliers", spec.outliers, range(0, 4097))
    return spec


def candidate_specs(spec: AutoSpec) -> list[str]:
    """Every codec spec a plan of ``spec`` may give a layer: the base at each point of the ladders,
    with each same-byte variant (as `_error_table` builds them), so a caller can check them all
    against a model's geometry before any calibration runs."""
    base = codecs.parse(spec.base)
    name, options = split_spec(spec.base)
    ladders = _ladders(spec)
    texts = []
    for values_of in itertools.product(*(ladder for _, ladder in ladders)):
        chosen = {key: str(v) for (key, _), v in zip(ladders, values_of)}
        for variant in _variants(spec.variants, base.name, options):
            texts.append(f"{name}:" + ",".join(f"{k}={v}" for k, v in {**options, **chosen, **variant}.items()))
    return texts


def is_auto(text: str) -> bool:
    """Whether ``text`` is an ``auto:...`` spec (without parsing its options)."""
    return spec_kind(text) is SpecKind.AUTO


def _dash_list(option: str, text: str, valid: Sequence[int]) -> list[int]:
    """The integers of a dash-separated option such as ``widths=2-3-4``, each one of ``valid``."""
    shown = f"{valid[0]}..{valid[-1]}" if isinstance(valid, range) else ", ".join(map(str, valid))
    try:
        values = [int(part) for part in text.split("-")]
    except ValueError:
        values = None
    if not values or any(v not in valid for v in values):
        raise SpecError(f"auto: option {option}={text!r} must be dash-separated integers, each of {shown} "
                        f"(e.g. {option}={valid[0]}-{valid[1]})")
    return values


@dataclass
class Plan:
    specs: list[str]  # one codec spec per layer
    # measured from the stored bytes of the calibration prefix (perhead=true: the sum of one-head layouts, each
    # field padded to 16 bytes per head, so a layer written as its plain base spec stores a little less)
    bits_per_value: float
    error: float  # summed relative attention-output error of the chosen widths
    calib_kl: float | None = None  # for kl=K: the KL measured on the prefix's tail for this plan


def _attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> float:
    """Relative output error of causal attention for queries q [Hq, n, D] at the last n positions."""
    hq, n, d = q.shape
    t = k.shape[0]
    group = hq // k.shape[1]
    mask = torch.arange(t)[None, :] > torch.arange(t - n, t)[:, None]

    def attend(keys, values):
        keys = keys.float().transpose(0, 1).repeat_interleave(group, 0)
        values = values.float().transpose(0, 1).repeat_interleave(group, 0)
        scores = (q.float() @ keys.transpose(1, 2) / d**0.5).masked_fill(mask, float("-inf"))
        return scores.softmax(-1) @ values, scores.argmax(-1)

    exact, exact_top = attend(k, v)
    approx, approx_top = attend(kh, vh)
    # Output error plus the fraction of queries whose most-attended key changes: next-token loss
    # follows key-selection shifts more than the output norm shows.
    return float((approx - exact).norm() / exact.norm()) + float((approx_top != exact_top).float().mean())


def _ladders(spec: AutoSpec) -> list[tuple[str, list[int]]]:
    """The options the planner widens, each with its candidate values (narrowest first)."""
    ladders = [("kbits", sorted(int(w) for w in spec.widths.split("-"))),
               ("vbits", sorted(int(w) for w in spec.widths.split("-")))]
    if spec.stages:
        ladders.append(("stages", sorted(int(n) for n in spec.stages.split("-"))))
    if spec.outliers:
        ladders.append(("outliers", sorted(int(n) for n in spec.outliers.split("-"))))
    return ladders


def _units(spec: AutoSpec, layers: int, heads: int) -> list[tuple[int, int | None]]:
    """What the planner sizes one at a time: (layer, None) per layer, or (layer, head) with perhead=true."""
    if spec.perhead:
        return [(layer, head) for layer in range(layers) for head in range(heads)]
    return [(layer, None) for layer in range(layers)]


def _error_table(spec: AutoSpec, ladders, queries, keys, values, geometry: Geometry, page_size: int,
                 chunk_tokens: int, rotary: Rotary | None) -> dict[tuple[int, tuple[int, ...]], tuple[float, int, str]]:
    """(unit, ladder values) -> (attention error, stored bytes, spec): of the variants tried (same
    bytes by construction), the one with the lowest error. A unit is an index into `_units`: a layer,
    or one KV head of a layer (its keys and values on a one-head geometry, scored by its query group).
    With ``planseeds=N`` each error is the mean over the base's seed and the N - 1 seeds after it (the bytes
    do not depend on the seed; the spec kept names the base's own seed)."""
    base = codecs.parse(spec.base)
    if not (hasattr(base, "kbits") and hasattr(base, "vbits")):
        raise SpecError(f"auto: base must be a codec with kbits/vbits options (kivi, qvg, qvg-pro, quantwm), "
                        f"got {spec.base!r}")
    name, options = split_spec(spec.base)
    first_seed = getattr(base, "seed", 0)
    group = queries[0].shape[0] // geometry.num_kv_heads
    one_head = dataclasses.replace(geometry, num_kv_heads=1)
    table: dict[tuple[int, tuple[int, ...]], tuple[float, int, str]] = {}
    for unit, (layer, head) in enumerate(_units(spec, len(keys), geometry.num_kv_heads)):
        k, v, q, g = keys[layer], values[layer], queries[layer], geometry
        if head is not None:
            k, v, g = k[:, head : head + 1], v[:, head : head + 1], one_head
            q = q[head * group : (head + 1) * group]
        n = min(spec.queries, k.shape[0])
        scored = q[:, k.shape[0] - n : k.shape[0]]
        for values_of in itertools.product(*(ladder for _, ladder in ladders)):
            chosen = {key: str(x) for (key, _), x in zip(ladders, values_of)}
            for variant in _variants(spec.variants, base.name, options):
                def spec_text(**extra) -> str:
                    return f"{name}:" + ",".join(f"{key}={x}" for key, x in {**options, **chosen, **variant, **extra}.items())

                text = spec_text()
                errors = []
                for draw in range(spec.planseeds):  # draw 0 is the spec itself; the others differ in the seed alone
                    seeded = spec_text(seed=str(first_seed + draw)) if draw else text
                    rec = reconstruct_sequence(codecs.get(seeded), k, v, g, page_size, chunk_tokens, rotary, q)
                    errors.append(_attention_error(scored, k, v, rec.k, rec.v))
                entry = (sum(errors) / len(errors), rec.stored_bytes, text)
                if (unit, values_of) not in table or entry[0] < table[unit, values_of][0]:
                    table[unit, values_of] = entry
    return table


def _layer_specs(spec: AutoSpec, ladders, table, state: list[tuple[int, ...]], layers: int) -> list[str]:
    """One codec spec per layer for a greedy state: a layer whose heads all chose the same spec keeps it;
    one whose heads differ becomes a heads: spec (the base's options, the ladders' values per head, the
    levers once)."""
    if not spec.perhead:
        return [table[unit, values_of][2] for unit, values_of in enumerate(state)]
    heads = len(state) // layers
    out = []
    for layer in range(layers):
        chosen = state[layer * heads : (layer + 1) * heads]
        texts = {table[layer * heads + h, values_of][2] for h, values_of in enumerate(chosen)}
        if len(texts) == 1:
            out.append(texts.pop())
            continue
        name, options = split_spec(spec.base)
        options, levers = split_levers(options, name)
        ladder_keys = [key for key, _ in ladders]
        base = f"{name}:" + ";".join(f"{k}={x}" for k, x in options.items() if k not in ladder_keys)
        per_head = ",".join(f"{key}=" + "-".join(str(values_of[d]) for values_of in chosen)
                            for d, key in enumerate(ladder_keys))
        out.append(f"heads:base={base.rstrip(':')},{per_head}" + (f",{levers.suffix()}" if levers.active else ""))
    return out


def _greedy_path(table, ladders, units: int, budget: float) -> list[tuple[list[tuple[int, ...]], int]]:
    """Every state of the greedy widening (narrowest first), with its stored bytes: each step moves one
    unit (a layer, or a layer's head) one rung up one ladder (key bits, value bits, stages or outliers)."""
    state = [tuple(ladder[0] for _, ladder in ladders)] * units
    used = sum(table[unit, values_of][1] for unit, values_of in enumerate(state))
    path = [(list(state), used)]
    while True:
        best = None
        for unit, current in enumerate(state):
            err, size, _ = table[unit, current]
            for d, (_, ladder) in enumerate(ladders):
                rung = _next(ladder, current[d])
                if rung is None:
                    continue
                moved = current[:d] + (rung,) + current[d + 1 :]
                new_err, new_size, _ = table[unit, moved]
                extra = new_size - size
                if used + extra > budget or new_err >= err:
                    continue
                gain = (err - new_err) / max(extra, 1)
                if best is None or gain > best[0]:
                    best = (gain, unit, moved, extra)
        if best is None:
            return path
        _, unit, choice, extra = best
        state[unit] = choice
        used += extra
        path.append((list(state), used))


def plan_widths(spec: AutoSpec, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
                geometry: Geometry, page_size: int, chunk_tokens: int, rotary: Rotary | None,
                kl_of: Callable[[list[str]], float] | None = None) -> Plan:
    """Choose per-layer widths. ``queries[l]`` [Hq, T, D], ``keys[l]``/``values[l]`` [T, H, D] of the prefix.

    ``kl_of(specs)`` measures a plan's next-token KL on the prefix's tail; ``auto:kl=K`` needs it.
    """
    if spec.kl > 0 and kl_of is None:
        raise SpecError("auto: kl=K needs the model to measure KL on the prefix (run it through `kvbackend eval`)")
    ladders = _ladders(spec)
    layers = len(keys)
    units = len(_units(spec, layers, geometry.num_kv_heads))
    values_total = sum(k.shape[0] for k in keys) * geometry.values_per_token
    table = _error_table(spec, ladders, queries, keys, values, geometry, page_size, chunk_tokens, rotary)
    as_specs = lambda state: _layer_specs(spec, ladders, table, state, layers)  # noqa: E731
    as_error = lambda state: sum(table[unit, v][0] for unit, v in enumerate(state))  # noqa: E731
    if spec.bpv > 0:
        budget = spec.bpv * values_total / 8
        path = _greedy_path(table, ladders, units, budget)
        state, used = path[-1]
        if used > budget:
            raise SpecError(f"auto: bpv={spec.bpv} cannot be met; the narrowest widths of {spec.base!r} already "
                            f"need {8.0 * used / values_total:.3f} bpv on this prefix")
        return Plan(as_specs(state), 8.0 * used / values_total, as_error(state))
    path = _greedy_path(table, ladders, units, float("inf"))
    measured: dict[int, float] = {}

    def kl_at(i: int) -> float:
        if i not in measured:
            measured[i] = kl_of(as_specs(path[i][0]))
        return measured[i]

    lo, hi = 0, len(path) - 1  # find the first state within the budget (KL falls along the path)
    if kl_at(hi) > spec.kl:
        lo = hi  # even the widest plan misses the budget: keep the widest (the report says its KL)
    while lo < hi:
        mid = (lo + hi) // 2
        if kl_at(mid) <= spec.kl:
            hi = mid
        else:
            lo = mid + 1
    state, used = path[lo]
    return Plan(as_specs(state), 8.0 * used / values_total, as_error(state), kl_at(lo))


def _next(widths: list[int], current: int) -> int | None:
    bigger = [w for w in widths if w > current]
    return bigger[0] if bigger else None


def cache_specs(specs: Sequence[str]) -> tuple[list[str], list[Levers]]:
    """A plan's per-layer specs as a paged cache takes them: codec specs without the sequence levers
    (for ``CacheConfig(layer_codecs=...)``) and each layer's levers (applied around the cache, e.g. by
    ``KVBackendCache.from_plan``).

    Raises:
        SpecError: a layer uses the post-hoc ``psac=`` lever (`kvbackend eval` only).
    """
    parsed = [codecs.get(spec) for spec in specs]
    if any(codec.levers.psac for codec in parsed):
        raise SpecError("the psac= lever corrects whole sequences after the fact (kvbackend eval only); "
                        "use quantwm:rank=R for a correction stored in the pages")
    return [format_spec(codec.spec) for codec in parsed], [codec.levers for codec in parsed]
