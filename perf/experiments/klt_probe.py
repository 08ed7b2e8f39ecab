"""`kvbackend probe`'s far-away recall rows, answered with a ``klt:`` prompt cache (a sequence-level format the paged
cache does not serve, so not through `KVBackendCache`): each prompt but its last token is captured exactly, coded
and decoded by `kvbackend.klt` with key bases fitted on another text, and the model answers greedily from that
cache; the exact cache's answers are the reference (agreement), the planted passcodes the truth.

    .venv/bin/python -P perf/experiments/klt_probe.py FILLER CALIB_TEXT PREFIX QUESTIONS SEED SPEC... > OUT.json
"""
import json
import sys

import torch
from transformers import DynamicCache

from kvbackend.klt import parse_klt, reconstruct
from kvbackend.rope import rotary_from_config
from kvbackend.tools.evaluate import capture_exact, key_bases_from_text
from kvbackend.tools.models import cache_argument, load_model
from kvbackend.tools.probe import ANSWER_TOKENS, _answer, probe_rows


def main(filler: str, calib: str, prefix: int, questions: int, seed: int, specs: list[str]) -> None:
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    rotary = rotary_from_config(model.config)
    bases = key_bases_from_text(model, tokenizer(open(calib).read(), return_tensors="pt").input_ids)
    rows = probe_rows(tokenizer, open(filler).read(), prefix, questions, seed)

    def answer(ids, cache):
        out = model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                             pad_token_id=model.config.pad_token_id, **cache_argument(model, cache))
        return _answer(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))

    prompts = [tokenizer(row.prompt, return_tensors="pt").input_ids for row in rows]
    exact = [answer(ids, DynamicCache(config=model.config)) for ids in prompts]
    results = {"filler": filler, "calib": calib, "prefix": prefix, "questions": questions, "seed": seed,
               "truth": [row.truth for row in rows], "exact": exact, "specs": {}}
    print(f"exact: {sum(a == r.truth for a, r in zip(exact, rows))}/{len(rows)} right", file=sys.stderr, flush=True)
    for spec in specs:
        parsed, got = parse_klt(spec), []
        for ids in prompts:
            cap = capture_exact(model, ids[:, :-1])
            k_all = torch.stack([k.transpose(0, 1) for k in cap.k])
            v_all = torch.stack([v.transpose(0, 1) for v in cap.v])
            seq = reconstruct(parsed, bases, k_all, v_all, rotary)
            cache = DynamicCache(config=model.config)
            for layer in range(seq.k.shape[0]):
                cache.update(seq.k[layer].transpose(0, 1)[None].to(cap.k[0].dtype),
                             seq.v[layer].transpose(0, 1)[None].to(cap.v[0].dtype), layer)
            got.append(answer(ids, cache))
        agree = sum(a == b for a, b in zip(got, exact))
        results["specs"][spec] = {"answers": got, "agree": agree, "correct": sum(a == r.truth for a, r in zip(got, rows))}
        print(f"{spec}: agrees on {agree}/{len(rows)}", file=sys.stderr, flush=True)
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
