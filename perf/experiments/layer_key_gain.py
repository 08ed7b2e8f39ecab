"""Which layers' key error costs most KL, after a short and after a long compressed prefix?

For one text and spec: the next-token KL of the continuation with every layer decoded, then with one layer's
keys exact at a time (the others decoded): the drop is what that layer's key error costs. Run at 6144 and at
1536s4608 (the same continuation), it shows whether the layers a long context pays for are the ones a short one
does (the `depth:` plans gave 3-bit keys to the layers a 1536-token scan picked).

    .venv/bin/python -P perf/experiments/layer_key_gain.py TEXT SPEC PREFIX SKIP OUT.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decoded_prefix import decoded_prefix  # noqa: E402

from kvbackend.tools.evaluate import _continuation_logits, _next_token_metrics  # noqa: E402


def main(text: str, spec: str, prefix: int, skip: int, out: str) -> None:
    run = decoded_prefix(text, spec, prefix, skip)
    model, ids, exact, pre_k, pre_v = run.model, run.ids, run.exact, run.pre_k, run.pre_v
    layers = len(exact.k)
    cont_ids = ids[:, prefix:]
    targets = ids[0, prefix + 1 :]
    ref = _continuation_logits(model, [k[:, :prefix] for k in exact.k], [v[:, :prefix] for v in exact.v], cont_ids)
    keys = [k.transpose(0, 1) for k in pre_k]
    values = [v.transpose(0, 1) for v in pre_v]
    base = _next_token_metrics(ref, _continuation_logits(model, keys, values, cont_ids), targets)[0]
    print(f"all decoded: KL {base:.5f}", flush=True)
    gains = []
    for layer in range(layers):
        swapped = list(keys)
        swapped[layer] = exact.k[layer][:, :prefix]
        kl = _next_token_metrics(ref, _continuation_logits(model, swapped, values, cont_ids), targets)[0]
        gains.append(dict(layer=layer, kl=kl, drop=base - kl))
        print(f"layer {layer:2d} keys exact: KL {kl:.5f} (drop {base - kl:+.5f})", flush=True)
    with open(out, "w") as f:
        json.dump(dict(text=text, spec=spec, prefix=prefix, skip=skip, kl=base, layers=gains), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
