"""Quality per byte of codecs encoded one storage page at a time (64-token chunks), as the SGLang and vLLM storage
adapters store them: `kvbackend eval`'s paged path with ``chunk_tokens`` equal to the page, so every page is its own
chunk (its own centroids, PSAC basis, outliers). Answers which page codec the adapters should derive from the
recommended spec.

    .venv/bin/python perf/experiments/page_codec_quality.py --text T --out F.json SPEC [SPEC ...]
"""
import argparse
import json
from dataclasses import asdict

from kvbackend.tools.evaluate import EvalSettings, evaluate
from kvbackend.tools.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("specs", nargs="+")
    args = ap.parse_args()
    settings = EvalSettings(chunk_tokens=args.page, page_size=args.page)
    model, tokenizer = load_model()
    with open(args.text, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids
    results = evaluate(model, ids, list(args.specs), settings)
    rows = [asdict(r) for r in results]
    for r in rows:
        print(f"{r['bpv']:.3f} bpv  KL {r['kl']:.4f}  top-1 {r['top1_agree']:.3f}  attn {r['attn_out_err']:.4f}  {r['spec']}")
    with open(args.out, "w") as f:
        json.dump({"text": args.text, "settings": asdict(settings), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
