"""Experiment (not product code; run: .venv/bin/python perf/experiments/kmeans_restarts.py R TEXT SPEC [PREFIX]): k-means++ best of R seedings per head for the first chunk, patched into QVG's
encode; the recommended spec on technical text over seeds 0..2 (1536 tokens)."""
import sys, json
import torch
from kvbackend.codecs import kmeans as km, qvg
from kvbackend.codecs.kmeans import assign_nearest, kmeans, kmeanspp_init

R = int(sys.argv[1])
orig_kmeans = qvg.kmeans

def best_of(x, init, iters, _state={"gen": None}):
    return orig_kmeans(x, init, iters)

orig_init = qvg.kmeanspp_init
def patched_encode_chunks(self, k, v, layout, pages, codebook, state, units):
    # wrap the seeding: run R seedings (consecutive draws of the same generator), keep per row the lowest objective
    def multi_init(residual, c, generator, repeat=1):
        best, best_obj = None, None
        for _ in range(R):
            init = orig_init(residual, c, generator, repeat=repeat)
            res = orig_kmeans(residual, init, self.spec.iters)
            _, dist = assign_nearest(residual, res.centroids)
            obj = dist.mean(-1)
            if best is None:
                best, best_obj = res.centroids.clone(), obj
            else:
                better = obj < best_obj
                best = torch.where(better[:, None, None], res.centroids, best)
                best_obj = torch.minimum(obj, best_obj)
        return best  # Lloyd from the best converged centroids: at a fixed point already, so nothing moves
    saved = qvg._INITS["kmeans++"]
    qvg._INITS["kmeans++"] = multi_init
    try:
        return orig_encode(self, k, v, layout, pages, codebook, state, units)
    finally:
        qvg._INITS["kmeans++"] = saved

orig_encode = qvg.QVGCodec._encode_chunks
qvg.QVGCodec._encode_chunks = patched_encode_chunks

from kvbackend.tools.evaluate import EvalSettings, evaluate
from kvbackend.tools.models import load_model
model, tok = load_model()
text = open(sys.argv[2]).read()
ids = tok(text, return_tensors="pt").input_ids
spec = sys.argv[3]
specs = [f"{spec},seed={s}" for s in range(3)]
res = evaluate(model, ids, specs, EvalSettings(prefix=int(sys.argv[4]) if len(sys.argv) > 4 else 1536))
for r in res:
    print(r.spec[-7:], round(r.bpv, 3), round(r.kl, 4), round(r.top1_agree * 100, 1))
