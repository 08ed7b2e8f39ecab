"""Keys after RoPE around a rotated pre-RoPE mean: does it keep pre-RoPE quality (session 58's question)?

Three frames for the same `chw:` page codec (widths per channel planned on another text's variances of what is
coded, as `kvbackend.klt.page_specs` plans them; values Hadamard-rotated; the first 4 tokens exact):
- ``pre``: keys de-rotated to before RoPE, coded around each chunk's channel means (what the planner serves today);
- ``post``: keys as attention reads them, coded around each chunk's channel means (`klt:...,rope=post`);
- ``rmean``: keys as attention reads them minus R(pos) mu, mu each chunk's pre-RoPE channel mean (fp16, in the
  chunk's slot in place of the post-RoPE mean), coded around ~0; a reader adds R(pos) mu back (for a kernel: one
  tensor-core product a page with a fixed in-page cos/sin operand, `perf/NOTES.md`).
Each is measured as `kvbackend eval` measures whole-sequence formats (`_whole_sequence_result`: KL and top-1 of the
continuation after the coded prefix); the bytes are the codec's (the same in every frame) plus the exact sinks, and
for ``rmean`` its fp16 pre-RoPE mean a chunk and channel (kept beside the codec's slot, which holds the coded
residual's own mean: a format of its own would hold only one of them).

    .venv/bin/python -P perf/experiments/chw_rotated_mean.py TEXT CALIB_TEXT [PREFIX [SKIP]] > OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from kvbackend import Geometry, codecs
from kvbackend.klt import KeyBases, widths as plan_widths
from kvbackend.levers import rotate_values
from kvbackend.rope import rotary_from_config
from kvbackend.tools.evaluate import EvalSettings, _continuation_logits, _whole_sequence_result, capture_exact
from kvbackend.tools.models import load_model

KBITS, PAGE, CHUNK, SINK, CALIB_TOKENS = 2.85, 64, 2048, 4, 2048
FRAMES = ("pre", "post", "rmean")


def coded_variances(cap, rotary, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per frame, the calibration capture's variances [L, H, D] of the query-weighted quantity each frame codes."""
    out = {f: [] for f in FRAMES}
    for layer, k_post in enumerate(cap.k):  # [H, T, D]
        k_post = k_post.float()
        t = torch.arange(k_post.shape[1])
        scale = w[layer].sqrt()[:, None]  # [H, 1, D], RoPE pairs share it
        pre = rotary.derotate(k_post, t) * scale
        out["pre"].append(pre.var(1))
        out["post"].append((k_post * scale).var(1))
        out["rmean"].append(rotary.rotate(pre - pre.mean(1, keepdim=True), t).var(1))
    return {f: torch.stack(v).clamp_min(1e-12) for f, v in out.items()}


def code_frame(frame: str, kw: list[str], k: torch.Tensor, v: torch.Tensor, rotary, first: int):
    """Decoded (k, v) [L, T, H, D] and the bytes stored, the sequence's first token at position ``first``."""
    layers, tokens, heads, dim = k.shape
    out_k, out_v, stored = torch.empty_like(k, dtype=torch.float32), torch.empty_like(v, dtype=torch.float32), 0
    for layer in range(layers):
        codec = codecs.get(f"chw:kw={kw[layer]},vbits=2,vstep=1.15")
        layout = codec.layout(Geometry(1, heads, dim, torch.float32), PAGE)
        for c0 in range(0, tokens, CHUNK):
            n = min(CHUNK, tokens - c0)
            padded = -(-n // PAGE) * PAGE
            pos = torch.arange(first + c0, first + c0 + padded)
            kc = torch.zeros(padded, heads, dim)
            vc = torch.zeros(padded, heads, dim)
            kc[:n], vc[:n] = k[layer, c0:c0 + n].float(), v[layer, c0:c0 + n].float()
            kc[n:], vc[n:] = kc[n - 1], vc[n - 1]  # a partial chunk padded with its last token (not counted below)
            base = None
            if frame == "pre":
                x = rotary.derotate(kc.transpose(0, 1), pos).transpose(0, 1)
            elif frame == "post":
                x = kc
            else:
                pre = rotary.derotate(kc.transpose(0, 1), pos)  # [H, T, D]
                mu = pre[:, :n].mean(1, keepdim=True).half().float()  # fp16, as a slot stores it
                base = rotary.rotate(mu.expand_as(pre).contiguous(), pos).transpose(0, 1)  # R(pos) mu, [T, H, D]
                x = kc - base
            enc = codec.encode(x, rotate_values(vc), layout)
            dk, dv = codec.decode(enc)
            if frame == "pre":
                dk = rotary.rotate(dk.float().transpose(0, 1), pos).transpose(0, 1)
            elif frame == "rmean":
                dk = dk.float() + base
            out_k[layer, c0:c0 + n], out_v[layer, c0:c0 + n] = dk[:n], rotate_values(dv.float())[:n]
            stored += (enc.pages.nbytes + enc.codebook.nbytes) * n // padded
            if frame == "rmean":  # its pre-RoPE mean, fp16 [H, D] a chunk, beside the codec's slot
                stored += 2 * heads * dim
        if first == 0:  # the exact sinks (fp16)
            out_k[layer, :SINK], out_v[layer, :SINK] = k[layer, :SINK].half().float(), v[layer, :SINK].half().float()
            stored += 2 * SINK * heads * dim * 2
    return out_k, out_v, stored


def main(text: str, calib: str, prefix: int = 1536, skip: int = 0) -> None:
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    rotary = rotary_from_config(model.config)
    ids = tokenizer(open(text).read(), return_tensors="pt").input_ids[:, skip:]
    calib_ids = tokenizer(open(calib).read(), return_tensors="pt").input_ids
    cap = capture_exact(model, calib_ids[:, :CALIB_TOKENS])  # one pass: the query weights and the variances
    bases = KeyBases.fit([q.float() for q in cap.q], [k.float() for k in cap.k], rotary)  # as key_bases_from_text
    variances = coded_variances(cap, rotary, bases.w)
    s = EvalSettings(tokens=prefix + 512, prefix=prefix, cont=512, queries=128, chunk_tokens=CHUNK)
    need = s.prefix + s.cont
    ids = ids[:, :need]
    exact = capture_exact(model, ids)
    cont_ids = ids[:, s.prefix:s.prefix + s.cont]
    targets = ids[0, s.prefix + 1:s.prefix + s.cont]
    ref = _continuation_logits(model, [k[:, :s.prefix] for k in exact.k], [v[:, :s.prefix] for v in exact.v],
                               cont_ids)
    out = {"text": text, "calib": calib, "prefix": prefix, "skip": skip, "kbits": KBITS, "rows": []}
    for frame in FRAMES:
        width = plan_widths(variances[frame], KBITS, PAGE, group=PAGE)  # [L, H, D]
        kw = ["".join(str(int(b)) for b in layer.flatten()) for layer in width]
        calls = []

        def code(k, v):
            first = 0 if not calls else s.prefix
            calls.append(first)
            return code_frame(frame, kw, k, v, rotary, first)

        r = _whole_sequence_result(frame, frame, code, exact, s, model, cont_ids, targets, ref)
        row = {"frame": frame, "bpv": r.bpv, "kl": r.kl, "top1": r.top1_agree, "k_nrmse": r.k_nrmse,
               "attn_out_err": r.attn_out_err, "key_bits": float(width.float().mean())}
        out["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:5]))
