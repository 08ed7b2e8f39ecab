"""``kvbackend plan``: the per-layer page codecs of a planned spec, written once per model for a cache to serve.

``klt:...,axes=channels,paged=true`` takes its key widths from bases fitted on the calibration text
(`kvbackend.klt.page_specs`); ``auto:bpv=B`` plans widths on the text's first ``--prefix`` tokens (as `kvbackend
probe` does). The JSON file holds the layers' specs; ``KVBackendCache(config, codec=plan["layers"])`` or
``CacheConfig(layer_codecs=...)`` serve them.
"""

from __future__ import annotations

import json

from kvbackend.errors import SpecError

PAGE_SIZE = 64  # tokens per page of the caches the plan is made for (KVBackendCache's default)


def check_plan_spec(spec: str) -> None:
    """Refuse a spec `kvbackend plan` does not plan, before the model loads.

    Raises:
        SpecError: a klt spec without ``paged=true``, an ``auto:kl=K`` spec (it needs a continuation to measure),
            or anything else (a page codec or depth: spec is its own plan).
    """
    from kvbackend.klt import is_klt, parse_klt
    from kvbackend.tools.auto import parse_auto

    if is_klt(spec):
        if not parse_klt(spec).paged:
            raise SpecError(f"{spec}: only a paged klt spec has a page plan; add axes=channels,paged=true")
        return
    auto = parse_auto(spec)
    if auto is None:
        raise SpecError(f"{spec}: kvbackend plan plans klt:...,paged=true and auto:bpv=B specs; a page codec or "
                        "depth: spec is served as it is")
    if auto.kl > 0:
        raise SpecError(f"{spec}: auto:kl=K measures KL on a continuation; plan it with `kvbackend eval`")


def plan_specs(model, tokenizer, spec: str, text: str, prefix: int) -> list[str]:
    """One page codec spec per layer of ``model`` for ``spec``, planned on ``text``."""
    from kvbackend.klt import is_klt, page_specs, parse_klt
    from kvbackend.tools.evaluate import key_bases_from_text
    from kvbackend.tools.probe import plan_layers

    check_plan_spec(spec)
    if is_klt(spec):
        ids = tokenizer(text, return_tensors="pt").input_ids.to(model.device)
        if ids.shape[1] < 2:
            raise SpecError("the calibration text has fewer than 2 tokens")
        return page_specs(parse_klt(spec), key_bases_from_text(model, ids, tokens=prefix), PAGE_SIZE)
    return plan_layers(model, tokenizer, text, spec, prefix, PAGE_SIZE)


def run_plan_cli(args) -> int:
    from rich.console import Console

    from kvbackend.tools.evaluate import prepare_output
    from kvbackend.tools.models import load_model

    for spec in args.codec:
        check_plan_spec(spec)
    with open(args.calibration, encoding="utf-8") as f:
        text = f.read()
    prepare_output(args.out, "--out")
    console = Console(width=max(Console().width, 120))
    with console.status("loading SmolLM2-135M-Instruct from its GGUF file"):
        model, tokenizer = load_model(model_dir=args.model_dir, device=args.device)
    plans = []
    for spec in args.codec:
        with console.status(f"planning {spec} on {args.calibration}"):
            layers = plan_specs(model, tokenizer, spec, text, args.prefix)
        plans.append({"codec": spec, "layers": layers})
        console.print(f"{spec}: {len(layers)} layers, {len(set(layers))} distinct specs")
    with open(args.out, "w") as f:
        json.dump({"calibration": args.calibration, "prefix": args.prefix, "page_size": PAGE_SIZE,
                   "plans": plans}, f, indent=1)
    console.print(f"wrote {args.out}: a plan's \"layers\" are the codec= of KVBackendCache", markup=False)
    return 0
