"""Experiment, not product code: k-means++ best of R seedings per head (the lowest k-means objective kept), patched
into QVG's encode, for a spec over k-means seeds 0..2 (perf/NOTES.md, session 11: it did not lower KL).

    .venv/bin/python perf/experiments/kmeans_restarts.py R TEXT SPEC [PREFIX]
"""
import sys

import torch

from kvbackend.codecs import qvg
from kvbackend.codecs.kmeans import assign_nearest

SEEDING = qvg._INITS["kmeans++"]
ENCODE = qvg.QVGCodec._encode_chunks


def patched_encode_chunks(self, k, v, layout, pages, codebook, state, units, restarts=int(sys.argv[1])):
    def best_seeding(residual, c, generator, repeat=1):
        best = best_objective = None
        for _ in range(restarts):  # consecutive draws of the same generator
            result = qvg.kmeans(residual, SEEDING(residual, c, generator, repeat=repeat), self.spec.iters)
            objective = assign_nearest(residual, result.centroids)[1].mean(-1)
            if best is None:
                best, best_objective = result.centroids.clone(), objective
            else:
                better = objective < best_objective
                best = torch.where(better[:, None, None], result.centroids, best)
                best_objective = torch.minimum(objective, best_objective)
        return best  # the encode's own Lloyd steps then run from these centroids

    qvg._INITS["kmeans++"] = best_seeding
    try:
        return ENCODE(self, k, v, layout, pages, codebook, state, units)
    finally:
        qvg._INITS["kmeans++"] = SEEDING


def main() -> None:
    from kvbackend.tools.evaluate import EvalSettings, evaluate
    from kvbackend.tools.models import load_model

    qvg.QVGCodec._encode_chunks = patched_encode_chunks
    model, tokenizer = load_model()
    with open(sys.argv[2], encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids
    specs = [f"{sys.argv[3]},seed={s}" for s in range(3)]
    settings = EvalSettings(prefix=int(sys.argv[4]) if len(sys.argv) > 4 else 1536)
    for result in evaluate(model, ids, specs, settings):
        print(result.spec, f"{result.bpv:.3f}", f"{result.kl:.4f}", f"{result.top1_agree * 100:.1f}")


if __name__ == "__main__":
    main()
