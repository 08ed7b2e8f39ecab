"""The quality meter: what a codec does to a real model's attention and next-token predictions.

One exact forward pass captures every layer's queries, keys (post-RoPE) and values. Then, per
codec:
- the whole prefix is encoded (the last partial chunk included) and decoded;
- ``k_nrmse``/``v_nrmse``: ||X - X^|| / ||X|| over all layers;
- ``attn_out_err``/``top1_shift``: the last ``queries`` positions of a causal pass of ``tokens``
  tokens, every layer and query head, attention with exact vs reconstructed K/V;
- ``kl``/``top1_agree``/``ppl``: the next ``continue`` tokens are teacher-forced over the
  reconstructed prefix cache, against the same run over the exact prefix cache.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvbackend import codecs
from kvbackend.alignpred.spec import is_alignpred, parse_alignpred
from kvbackend.klt import is_klt, page_specs as klt_page_specs, parse_klt
from kvbackend.tools.seeds import expand, summarize
from kvbackend.errors import SpecError
from kvbackend.tools.models import cache_argument
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.levers import hadamard
from kvbackend.manager import KVCache
from kvbackend.frames import LeverFrame
from kvbackend.rope import Rotary, rope_not_undoable, rotary_from_config
from kvbackend.tools.auto import candidate_specs, parse_auto, plan_widths
from kvbackend.depth import is_depth, parse_depth
from kvbackend.depth import layer_specs as depth_layer_specs
from kvbackend.tools.reconstruct import reconstruct_sequence


@dataclass(frozen=True)
class EvalSettings:
    tokens: int = 2048  # tokens of the attention-fidelity pass
    prefix: int = 1536  # tokens cached through the codec
    cont: int = 512  # tokens teacher-forced after the prefix
    queries: int = 128  # last query positions scored for attention fidelity
    page_size: int = 64
    chunk_tokens: int = 2048  # codec chunk length
    device: str = "cpu"
    # "paged": K/V go through a KVCache (appends, chunk completions, page reads: what an engine runs);
    # "sim": the sequence-level simulation (reconstruct_sequence); "both": paged, with the simulation's
    # figures beside it as a cross-check (one more continuation pass per codec)
    path: str = "paged"

    def __post_init__(self) -> None:
        """Raise ValueError for numbers no run can use (before any model work)."""
        # cont >= 2: the first continuation token has no scored target (perplexity of nothing)
        for name, least in (("tokens", 1), ("prefix", 1), ("cont", 2), ("queries", 1), ("page_size", 1),
                            ("chunk_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")
        if self.queries > self.tokens:
            raise ValueError(f"queries={self.queries} must be at most tokens={self.tokens}")
        if self.chunk_tokens % self.page_size:
            raise ValueError(f"chunk_tokens={self.chunk_tokens} must be a multiple of page_size={self.page_size}")
        if self.path not in PATHS:
            raise ValueError(f"path={self.path!r}; valid: {', '.join(PATHS)}")


PATHS = ("paged", "sim", "both")


@dataclass
class CodecResult:
    spec: str  # the spec as given
    canonical: str  # the codec's canonical spec string (for auto: the first layer's)
    bpv: float  # 8 * stored bytes / values, for the compressed prefix
    stored_bytes: int
    k_nrmse: float
    v_nrmse: float
    attn_out_err: float
    top1_shift: float
    kl: float
    top1_agree: float
    ppl: float
    ppl_ref: float
    plan: list[str] | None = None  # per-layer specs chosen by auto:..., else None
    calib_kl: float | None = None  # auto:kl=K: the KL its plan reached on the prefix's own tail
    path: str = "paged"  # how the figures above were measured (EvalSettings.path)
    sim: dict | None = None  # path "both": the simulation's bpv, k_nrmse, v_nrmse, kl, top1_agree (a cross-check)


@dataclass
class Capture:
    """Exact per-layer tensors of one forward pass (batch 1)."""

    q: list[torch.Tensor]  # per layer [Hq, T, D]
    k: list[torch.Tensor]  # per layer [H, T, D], post-RoPE
    v: list[torch.Tensor]  # per layer [H, T, D]


def capture_exact(model, input_ids: torch.Tensor) -> Capture:
    """Run ``model`` once and keep each layer's queries, keys and values."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from kvbackend.integration.transformers import previous_attention, previous_mask

    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    previous = model.config._attn_implementation

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query[0].detach(), key[0].detach(), value[0].detach())
        # the attention the model runs (its eager one keeps soft-capping and attention sinks), not always SDPA
        return previous_attention(module, previous)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvbackend_capture", capture)
    if previous not in (None, "sdpa"):  # the implementation's own mask (SDPA's call builds its causal mask itself)
        AttentionMaskInterface.register("kvbackend_capture", previous_mask(previous))
    model.set_attn_implementation("kvbackend_capture")
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        model.set_attn_implementation(previous)
    layers = sorted(seen)
    return Capture([seen[i][0] for i in layers], [seen[i][1] for i in layers], [seen[i][2] for i in layers])


def attention_fidelity(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                       queries: int) -> tuple[float, float, int]:
    """(sum ||O - O^||^2, sum ||O||^2, top-1 changes) for the last ``queries`` positions of one layer.

    q: [Hq, T, D]; k, v, kh, vh: [H, T, D]. Causal: the query at position p sees keys 0..p.
    """
    hq, t, d = q.shape
    group = hq // k.shape[0]
    qs = q[:, t - queries :].float()
    positions = torch.arange(t - queries, t, device=q.device)
    mask = torch.arange(t, device=q.device)[None, :] > positions[:, None]  # [Q, T] future keys

    def attend(keys, values):
        keys = keys.float().repeat_interleave(group, 0)
        scores = (qs @ keys.transpose(1, 2)) / math.sqrt(d)
        scores = scores.masked_fill(mask, float("-inf"))
        return scores.softmax(-1) @ values.float().repeat_interleave(group, 0), scores.argmax(-1)

    out, top = attend(k, v)
    out_h, top_h = attend(kh, vh)
    return float(((out - out_h) ** 2).sum()), float((out**2).sum()), int((top != top_h).sum())


def _continuation_logits(model, prefix_k: list[torch.Tensor], prefix_v: list[torch.Tensor], cont_ids: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(zip(prefix_k, prefix_v)):
        cache.update(k[None], v[None], layer)
    with torch.no_grad():
        return model(cont_ids, **cache_argument(model, cache)).logits[0].float()


def _next_token_metrics(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float, float]:
    log_ref, log_test = ref.log_softmax(-1), test.log_softmax(-1)
    kl = float((log_ref.exp() * (log_ref - log_test)).sum(-1).mean())
    agree = float((ref.argmax(-1) == test.argmax(-1)).float().mean())
    n = targets.shape[0]
    nll = lambda logp: float(-logp[:n].gather(-1, targets[:, None]).mean())  # noqa: E731
    return kl, agree, math.exp(nll(log_test)), math.exp(nll(log_ref))


def _whole_sequence_result(spec: str, canonical: str, code, exact: Capture, s: EvalSettings, model, cont_ids, targets,
                           ref_logits) -> CodecResult:
    """A format coded over every layer of a sequence at once (``alignpred:``, ``klt:``), outside the paged cache.

    ``code(k, v)``, on float ``[L, T, H, D]`` CPU tensors of a sequence from its first token, returns the decoded
    ``(k, v)`` and the bytes stored. The prefix is coded as one sequence and the tokens after it (up to
    ``s.tokens``, for the attention-fidelity pass) as another."""
    device, dtype = exact.k[0].device, exact.k[0].dtype
    k_all = torch.stack([k.transpose(0, 1) for k in exact.k]).cpu()  # [L, T, H, D]
    v_all = torch.stack([v.transpose(0, 1) for v in exact.v]).cpu()
    pre_k, pre_v, stored = code(k_all[:, : s.prefix], v_all[:, : s.prefix])
    if s.tokens > s.prefix:
        rest_k, rest_v, _ = code(k_all[:, s.prefix : s.tokens], v_all[:, s.prefix : s.tokens])
        full_k, full_v = torch.cat([pre_k, rest_k], 1), torch.cat([pre_v, rest_v], 1)
    else:
        full_k, full_v = pre_k[:, : s.tokens], pre_v[:, : s.tokens]
    kx, vx = k_all[:, : s.prefix].float(), v_all[:, : s.prefix].float()
    out_err = out_norm = 0.0
    shifts = 0
    for layer in range(len(exact.k)):
        e, n, shift = attention_fidelity(exact.q[layer][:, : s.tokens], exact.k[layer][:, : s.tokens],
                                         exact.v[layer][:, : s.tokens], full_k[layer].transpose(0, 1).to(device, dtype),
                                         full_v[layer].transpose(0, 1).to(device, dtype), s.queries)
        out_err, out_norm, shifts = out_err + e, out_norm + n, shifts + shift
    test_logits = _continuation_logits(model, [k.transpose(0, 1).to(device, dtype) for k in pre_k],
                                       [v.transpose(0, 1).to(device, dtype) for v in pre_v], cont_ids)
    kl, agree, ppl, ppl_ref = _next_token_metrics(ref_logits, test_logits, targets)
    nrmse = lambda x, y: math.sqrt(float((x - y).square().sum()) / float(x.square().sum()))  # noqa: E731
    return CodecResult(spec=spec, canonical=canonical, bpv=8.0 * stored / (kx.numel() + vx.numel()),
                       stored_bytes=stored, k_nrmse=nrmse(kx, pre_k), v_nrmse=nrmse(vx, pre_v),
                       attn_out_err=math.sqrt(out_err / out_norm),
                       top1_shift=shifts / (len(exact.k) * exact.q[0].shape[0] * s.queries), kl=kl, top1_agree=agree,
                       ppl=ppl, ppl_ref=ppl_ref, path="sequence")


def _alignpred_result(spec: str, calibration,  exact: Capture, s: EvalSettings, model, cont_ids,
                      targets, ref_logits) -> CodecResult:
    """AlignPred codes page groups across every layer, so it is measured on all layers at once."""
    from kvbackend.alignpred import AlignPredCodec
    from kvbackend.alignpred.sequence import reconstruct as alignpred_reconstruct

    codec = AlignPredCodec(spec, calibration)

    def code(k, v):
        out = alignpred_reconstruct(codec, k, v, s.page_size)
        return out.k, out.v, out.stored_bytes

    return _whole_sequence_result(spec, codec.spec_string, code, exact, s, model, cont_ids, targets, ref_logits)


def _klt_result(spec: str, bases, exact: Capture, s: EvalSettings, model, cont_ids, targets, ref_logits,
                rotary) -> CodecResult:
    """``klt:`` keys on frozen axes (`kvbackend.klt`), measured on all layers of the prefix at once."""
    from kvbackend.klt import reconstruct as klt_reconstruct

    if bases is None:
        raise ValueError(f"{spec}: klt needs frozen key bases fitted on another text (--calibration TEXT)")
    parsed = parse_klt(spec)

    def code(k, v):
        out = klt_reconstruct(parsed, bases, k, v, rotary)
        return out.k, out.v, out.stored_bytes

    return _whole_sequence_result(spec, parsed.spec_string, code, exact, s, model, cont_ids, targets, ref_logits)


def _prefix_kl(model, exact: Capture, ids: torch.Tensor, s: EvalSettings, calib: int, geometry: Geometry, rotary):
    """``kl_of(per-layer specs)`` for `auto:kl=K`: the prefix's first part cached through the plan, its
    last ``calib`` tokens teacher-forced, KL against the exact cache. Uses only the prefix."""
    split = s.prefix - calib
    if split < s.page_size:
        raise ValueError(f"auto calib={calib} leaves {split} prefix tokens to cache; lower calib")
    window = ids[:, split : s.prefix]
    exact_k = [k[:, :split] for k in exact.k]
    exact_v = [v[:, :split] for v in exact.v]
    reference = _continuation_logits(model, exact_k, exact_v, window)

    def kl_of(specs: list[str]) -> float:
        ks, vs = [], []
        for layer, spec in enumerate(specs):
            k, v = exact.k[layer].transpose(0, 1)[:split], exact.v[layer].transpose(0, 1)[:split]
            rec = reconstruct_sequence(codecs.get(spec), k, v, geometry, s.page_size, s.chunk_tokens, rotary,
                                       exact.q[layer])
            ks.append(rec.k.transpose(0, 1))
            vs.append(rec.v.transpose(0, 1))
        test = _continuation_logits(model, ks, vs, window)
        log_ref, log_test = reference.log_softmax(-1), test.log_softmax(-1)
        return float((log_ref.exp() * (log_ref - log_test)).sum(-1).mean())

    return kl_of


def key_bases_from_text(model, input_ids: torch.Tensor, tokens: int = 2048):
    """Frozen `kvbackend.klt.KeyBases` fitted on the queries and keys of another text's first ``tokens`` tokens."""
    from kvbackend.klt import KeyBases

    cap = capture_exact(model, input_ids[:, :tokens])
    return KeyBases.fit([q.float().cpu() for q in cap.q], [k.float().cpu() for k in cap.k],
                        rotary_from_config(model.config))


def calibration_from_text(model, input_ids: torch.Tensor, tokens: int = 1024):
    """Frozen AlignPred predictors fitted on the exact KV of another text's first ``tokens`` tokens."""
    from kvbackend.alignpred import Calibration

    cap = capture_exact(model, input_ids[:, :tokens])
    k = torch.stack([x.transpose(0, 1) for x in cap.k]).float().cpu().numpy()
    v = torch.stack([x.transpose(0, 1) for x in cap.v]).float().cpu().numpy()
    return Calibration.fit(k, v)


def text_config_of(config):
    """The text model's part of a transformers config (the config itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def geometry_from_config(config) -> Geometry:
    """The KV geometry (float32, as `load_model` loads) of a transformers model config."""
    text = text_config_of(config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return Geometry(text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim,
                    torch.float32)


def model_geometry(model_dir: str | None = None) -> Geometry:
    """The KV geometry of the model `load_model` would load, from its config alone (no weights)."""
    from kvbackend.tools.models import load_config

    return geometry_from_config(load_config(model_dir=model_dir))


def check_specs(specs: Sequence[str], settings: EvalSettings, geometry: Geometry | None = None,
                rope_unfit: str | None = None) -> bool:
    """Parse every spec (bounds included); given the model's ``geometry``, also check that each codec,
    and every candidate of an ``auto:`` plan, can serve it at the eval's page size. Cheap: run it before
    loading a model. Returns whether a spec needs a calibration text (``alignpred:...,fit=frozen``, ``klt:``).
    ``rope_unfit``: why the model's RoPE is not one full-width rotation (`rope_not_undoable`), which refuses
    ``prerope=`` and ``pagerope=`` (keys would be compressed in a wrong frame).

    Raises:
        SpecError: the first spec that cannot run, with the reason.
    """
    frozen = False
    for spec in specs:
        if is_alignpred(spec):
            frozen |= parse_alignpred(spec).fit == "frozen"
            continue
        if is_klt(spec):
            parse_klt(spec)
            if rope_unfit:
                raise SpecError(f"{spec}: klt codes keys before RoPE, one full-width rotation, and this model's "
                                f"RoPE is not one: {rope_unfit}")
            frozen = True
            continue
        auto = parse_auto(spec)
        if auto is not None and auto.kl > 0 and settings.prefix - auto.calib < settings.page_size:
            raise SpecError(f"{spec}: auto calib={auto.calib} leaves {settings.prefix - auto.calib} prefix tokens "
                            f"to cache (--prefix {settings.prefix}), fewer than a page of {settings.page_size}; "
                            f"lower calib or raise --prefix")
        layers = [spec]
        if auto is not None:
            layers = candidate_specs(auto)
        elif is_depth(spec):  # parsing checks every band's value; with the model's layer count, each layer's spec
            depth = parse_depth(spec)
            layers = sorted(set(depth.layer_specs(geometry.num_layers))) if geometry else [depth.base]
        for text in layers:
            codec = codecs.get(text)
            if geometry is None:
                continue
            try:
                if rope_unfit and codec.levers.rope:
                    raise SpecError(f"prerope/pagerope undo the model's RoPE with one full-width rotation, and this "
                                    f"model's RoPE is not one: {rope_unfit}; use a spec without them")
                codec.layout(geometry, settings.page_size)
                if codec.levers.vrot == "hadamard":
                    hadamard(geometry.head_dim)
                if settings.path != "sim":  # the levers the paged cache serves (the model's RoPE comes later)
                    LeverFrame(codec.levers, Rotary.default(geometry.head_dim, 10000.0), settings.page_size).check(
                        settings.page_size, "--path paged")
            except SpecError as exc:
                where = (f" (a candidate of the plan: {text})" if auto is not None
                         else f" (a layer's spec: {text})" if text != spec else "")
                raise SpecError(f"{spec}{where}: {exc}") from None
    return frozen


def _widths_label(spec: str) -> str:
    """``k3v2`` for a layer's spec; ``k3-2-2v2-2-3`` (per KV head) for a heads: spec; ``k2.41v2`` (the mean key
    width) for a chw: spec."""
    parsed = codecs.parse(spec)
    if parsed.name == "heads":
        return f"k{parsed.kbits or '-'}v{parsed.vbits or '-'}"
    if parsed.name == "chw":  # a width per key channel: their mean
        widths = [int(c) for c in parsed.kw] or [parsed.kbits]
        return f"k{sum(widths) / len(widths):.2f}v{parsed.vbits}"
    return f"k{parsed.key_bits}v{parsed.value_bits}"


def prepare_output(path: str, option: str) -> None:
    """Create the folder of an output file now, so a bad path fails before the run, not after it."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{option} {path} is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise OSError(f"{option} {path}: cannot create its folder {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{option} {path}: folder {folder} is not writable")


def evaluate(model, input_ids: torch.Tensor, specs: list[str], settings: EvalSettings, progress=None,
             calibration=None, plan_ids: torch.Tensor | None = None, key_bases=None) -> list[CodecResult]:
    """Measure every codec in ``specs`` on ``input_ids [1, >= max(tokens, prefix + cont)]``.

    ``calibration`` serves ``alignpred:…,fit=frozen`` specs, ``key_bases`` (`key_bases_from_text`) ``klt:`` specs;
    fit both on other data than ``input_ids``.
    ``plan_ids [1, >= prefix]``: ``auto:`` specs are planned on these tokens' first ``prefix`` (another text: a
    plan made once for the model) instead of on ``input_ids``' own prefix.
    """
    s = settings
    check_specs(specs, s, geometry_from_config(model.config), rope_not_undoable(text_config_of(model.config)))
    need = max(s.tokens, s.prefix + s.cont)
    if input_ids.shape[1] < need:
        raise ValueError(f"the text has {input_ids.shape[1]} tokens; --tokens {s.tokens}, --prefix {s.prefix} and "
                         f"--continue {s.cont} need {need}")
    if not 0 < s.queries <= s.tokens:
        raise ValueError(f"queries={s.queries} must be in 1..tokens={s.tokens}")
    if plan_ids is not None and plan_ids.shape[1] < s.prefix:
        raise ValueError(f"the plan text has {plan_ids.shape[1]} tokens; planning on --prefix {s.prefix} needs "
                         f"{s.prefix}")
    ids = input_ids[:, :need].to(s.device)
    exact = capture_exact(model, ids)
    plan_exact = plan_tokens = None  # captured once, for the first auto: spec
    num_layers = len(exact.k)
    heads, _, head_dim = exact.k[0].shape
    geometry = Geometry(num_layers, heads, head_dim, exact.k[0].dtype)
    cont_ids = ids[:, s.prefix : s.prefix + s.cont]
    targets = ids[0, s.prefix + 1 : s.prefix + s.cont]
    ref_logits = _continuation_logits(model, [k[:, : s.prefix] for k in exact.k], [v[:, : s.prefix] for v in exact.v],
                                      cont_ids)
    rotary = rotary_from_config(model.config)
    results = []
    task = progress.add_task("codecs x layers", total=len(specs) * num_layers) if progress else None
    for spec in specs:
        paged_klt = is_klt(spec) and parse_klt(spec).paged
        if (is_alignpred(spec) or is_klt(spec)) and not paged_klt:  # whole-sequence formats: every layer at once
            results.append(_alignpred_result(spec, calibration, exact, s, model, cont_ids, targets, ref_logits)
                           if is_alignpred(spec) else
                           _klt_result(spec, key_bases, exact, s, model, cont_ids, targets, ref_logits, rotary))
            if progress:
                progress.advance(task, num_layers)
            continue
        auto = None if paged_klt else parse_auto(spec)
        plan = calib_kl = None
        if paged_klt:  # one chw: page codec per layer, widths from the frozen bases
            if key_bases is None:
                raise ValueError(f"{spec}: klt needs frozen key bases fitted on another text (--calibration TEXT)")
            plan = klt_page_specs(parse_klt(spec), key_bases, s.page_size)
        elif auto is not None:
            source, source_ids = exact, ids
            if plan_ids is not None:
                if plan_exact is None:
                    plan_tokens = plan_ids[:, : s.prefix].to(s.device)
                    plan_exact = capture_exact(model, plan_tokens)
                source, source_ids = plan_exact, plan_tokens
            kl_of = _prefix_kl(model, source, source_ids, s, auto.calib, geometry, rotary) if auto.kl > 0 else None
            chosen = plan_widths(auto, [q[:, : s.prefix] for q in source.q],
                                 [k.transpose(0, 1)[: s.prefix] for k in source.k],
                                 [v.transpose(0, 1)[: s.prefix] for v in source.v], geometry, s.page_size,
                                 s.chunk_tokens, rotary, kl_of)
            plan, calib_kl = chosen.specs, chosen.calib_kl
        layer_specs = list(plan) if plan else depth_layer_specs(spec, num_layers)
        main_path = "sim" if s.path == "sim" else "paged"
        measured = {}
        for path in (("paged", "sim") if s.path == "both" else (s.path,)):
            measured[path] = _measure(path, layer_specs, exact, geometry, s, rotary, model, cont_ids, targets,
                                      ref_logits, progress, task if path == main_path else None)
        main = measured[main_path]
        sim = measured["sim"] if s.path == "both" else None
        canonical = parse_klt(spec).spec_string if paged_klt else codecs.get(layer_specs[0]).spec_string
        results.append(CodecResult(spec=spec, canonical=canonical, **main, plan=plan,
                                   calib_kl=calib_kl, path=s.path,
                                   sim={k: sim[k] for k in ("bpv", "k_nrmse", "v_nrmse", "kl", "top1_agree")}
                                   if sim else None))
    return results


def paged_reconstruction(layer_specs: list[str], exact: "Capture", geometry: Geometry, settings: EvalSettings,
                         tokens: int, rotary) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The first ``tokens`` tokens of every layer appended to a `KVCache` of ``layer_specs`` (with their
    queries) and read back: (keys [T, H, D] per layer, values, stored bytes). Chunks are as long as the
    simulation's (``chunk_tokens``, or the whole span when it is shorter), in whole pages; a remainder
    shorter than a chunk stays dense, as in an engine, and its exact values count at the model's dtype."""
    p = settings.page_size
    chunk_pages = max(1, min(settings.chunk_tokens, tokens) // p)
    pages = -(-tokens // p)
    config = CacheConfig(layer_codecs=tuple(layer_specs), page_size=p, chunk_pages=chunk_pages,
                         dense_pages=pages + 1, packed_pages=pages + chunk_pages, device=settings.device)
    cache = KVCache(geometry, config, rotary=rotary)
    rid, _ = cache.add_request()
    for layer in range(geometry.num_layers):
        k, v = exact.k[layer].transpose(0, 1)[:tokens], exact.v[layer].transpose(0, 1)[:tokens]
        cache.append(rid, layer, k.contiguous(), v.contiguous(),
                     queries=exact.q[layer][:, :tokens].transpose(0, 1).contiguous())
    reads = [cache.read(rid, layer) for layer in range(geometry.num_layers)]
    stats = cache.stats()
    dense_tokens = tokens - cache.page_table(rid).num_packed_tokens
    element = torch.empty((), dtype=geometry.dtype).element_size()
    stored = stats.packed_bytes + dense_tokens * geometry.num_layers * geometry.values_per_token * element
    return [r[0] for r in reads], [r[1] for r in reads], stored


def _measure(path: str, layer_specs: list[str], exact: "Capture", geometry: Geometry, s: EvalSettings, rotary,
             model, cont_ids, targets, ref_logits, progress, task) -> dict:
    """Every figure of one codec (one spec per layer) measured along ``path`` ("paged" or "sim")."""
    num_layers = geometry.num_layers
    layer_codecs = [codecs.get(spec) for spec in layer_specs]
    if path == "paged":
        pre_k, pre_v, stored = paged_reconstruction(layer_specs, exact, geometry, s, s.prefix, rotary)
        full_k, full_v = (pre_k, pre_v) if s.tokens == s.prefix else \
            paged_reconstruction(layer_specs, exact, geometry, s, s.tokens, rotary)[:2]
    else:
        pre_k, pre_v, full_k, full_v, stored = [], [], [], [], 0
        for layer in range(num_layers):
            k, v = exact.k[layer].transpose(0, 1), exact.v[layer].transpose(0, 1)  # [T, H, D]
            pre = reconstruct_sequence(layer_codecs[layer], k[: s.prefix], v[: s.prefix], geometry, s.page_size,
                                       s.chunk_tokens, rotary, exact.q[layer])
            stored += pre.stored_bytes
            pre_k.append(pre.k)
            pre_v.append(pre.v)
            full = pre if s.tokens == s.prefix else reconstruct_sequence(
                layer_codecs[layer], k[: s.tokens], v[: s.tokens], geometry, s.page_size, s.chunk_tokens, rotary,
                exact.q[layer])
            full_k.append(full.k)
            full_v.append(full.v)
    err_k = err_v = norm_k = norm_v = out_err = out_norm = 0.0
    shifts = 0
    for layer in range(num_layers):
        kx = exact.k[layer].transpose(0, 1)[: s.prefix].float()
        vx = exact.v[layer].transpose(0, 1)[: s.prefix].float()
        err_k += float(((kx - pre_k[layer].float()) ** 2).sum())
        err_v += float(((vx - pre_v[layer].float()) ** 2).sum())
        norm_k += float((kx**2).sum())
        norm_v += float((vx**2).sum())
        e, n, shift = attention_fidelity(exact.q[layer][:, : s.tokens], exact.k[layer][:, : s.tokens],
                                         exact.v[layer][:, : s.tokens], full_k[layer].transpose(0, 1),
                                         full_v[layer].transpose(0, 1), s.queries)
        out_err, out_norm, shifts = out_err + e, out_norm + n, shifts + shift
        if progress and task is not None:
            progress.advance(task)
    test_logits = _continuation_logits(model, [k.transpose(0, 1) for k in pre_k], [v.transpose(0, 1) for v in pre_v],
                                       cont_ids)
    kl, agree, ppl, ppl_ref = _next_token_metrics(ref_logits, test_logits, targets)
    values = s.prefix * num_layers * geometry.values_per_token
    return dict(bpv=8.0 * stored / values, stored_bytes=stored, k_nrmse=math.sqrt(err_k / norm_k),
                v_nrmse=math.sqrt(err_v / norm_v), attn_out_err=math.sqrt(out_err / out_norm),
                top1_shift=shifts / (num_layers * exact.q[0].shape[0] * s.queries), kl=kl, top1_agree=agree,
                ppl=ppl, ppl_ref=ppl_ref)


def write_json(path: str, results: list[CodecResult], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "codecs": [asdict(r) for r in results]}, f, indent=2)


def pareto_plot(path: str, results: list[CodecResult], title: str) -> None:
    """KL and attention output error against bpv: one numbered point per codec, the specs listed below
    (long specs would cover each other beside the points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 160  # characters per line of the spec list (specs have no spaces to break at)
    legend = []
    for i, r in enumerate(results, 1):
        entry = f"{i}: {r.spec}"
        legend += [entry[j : j + width] for j in range(0, len(entry), width)]
    lines = len(legend)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5 + 0.17 * lines))
    for ax, key, label in ((axes[0], "kl", "next-token KL (exact || codec)"), (axes[1], "attn_out_err", "attention output error")):
        xs = [r.bpv for r in results]
        ys = [max(getattr(r, key), 1e-7) for r in results]
        ax.scatter(xs, ys)
        for i, (x, y) in enumerate(zip(xs, ys), 1):
            ax.annotate(str(i), (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bits per value (from stored bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    bottom = (0.17 * lines + 0.3) / (5 + 0.17 * lines)  # the share of the figure the spec list takes
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.text(0.01, bottom - 0.01, "\n".join(legend), fontsize=7, family="monospace", va="top")
    fig.savefig(path, dpi=120)
    plt.close(fig)


COLUMNS = ("bpv", "k_nrmse", "v_nrmse", "attn_out_err", "top1_shift", "kl", "top1_agree", "ppl")


def run_eval_cli(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvbackend.tools.models import load_model

    console = Console(width=max(Console().width, 150))
    # Everything that can be checked is checked before the model loads: numbers, specs, files.
    settings = EvalSettings(tokens=args.tokens, prefix=args.prefix, cont=args.cont,
                            queries=min(128, args.tokens), chunk_tokens=getattr(args, "chunk", 2048),
                            device=args.device, path=getattr(args, "path", "paged"))
    runs = expand(args.codec, getattr(args, "seeds", 1))  # (spec as given, spec run): seeded specs once per seed
    specs = [run for _, run in runs]
    frozen = check_specs(specs, settings)
    if frozen and not args.calibration:
        raise SystemExit("alignpred fit=frozen and klt: need --calibration TEXT (another text than --text)")
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        if path:
            prepare_output(path, option)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    calibration_text = None
    if frozen:
        with open(args.calibration, encoding="utf-8") as f:
            calibration_text = f.read()
    plan_text = None
    plan_path = getattr(args, "plan_text", None)
    if plan_path and not any(parse_auto(spec) is not None for spec in specs):
        raise SystemExit("--plan-text plans auto:... specs, and no --codec is one")
    if plan_path:
        with open(plan_path, encoding="utf-8") as f:
            plan_text = f.read()
    check_specs(specs, settings, model_geometry(args.model_dir))
    with console.status("loading model"):
        model, tokenizer = load_model(model_dir=args.model_dir, device=args.device)
    ids = tokenizer(text, return_tensors="pt").input_ids
    skip = getattr(args, "skip", 0)
    need = max(settings.tokens, settings.prefix + settings.cont)
    if skip and ids.shape[1] - skip < need:
        raise SystemExit(f"{args.text} has {ids.shape[1]} tokens; --skip {skip} leaves {max(0, ids.shape[1] - skip)}, "
                         f"and --tokens {settings.tokens}, --prefix {settings.prefix} and --continue {settings.cont} "
                         f"need {need}")
    ids = ids[:, skip:]
    calibration = key_bases = None
    if frozen:
        calib_ids = tokenizer(calibration_text, return_tensors="pt").input_ids.to(args.device)
        if any(is_alignpred(spec) and parse_alignpred(spec).fit == "frozen" for spec in specs):
            calibration = calibration_from_text(model, calib_ids)
        if any(is_klt(spec) for spec in specs):
            key_bases = key_bases_from_text(model, calib_ids)
    plan_ids = tokenizer(plan_text, return_tensors="pt").input_ids if plan_text is not None else None
    with Progress(console=console, transient=True) as progress:
        results = evaluate(model, ids, specs, settings, progress, calibration, plan_ids, key_bases=key_bases)
    table = Table(title=f"{args.text}{f' from token {skip}' if skip else ''}: {settings.tokens} tokens, prefix "
                        f"{settings.prefix} + {settings.cont}, "
                        f"ppl_ref {results[0].ppl_ref:.2f}")
    table.add_column("spec", overflow="fold")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r.spec, *(f"{getattr(r, c):.4f}" if c != "bpv" else f"{r.bpv:.3f}" for c in COLUMNS))
    console.print(table)
    for r in results:
        if r.plan:
            calib = f", KL {r.calib_kl:.4f} on the prefix's tail" if r.calib_kl is not None else ""
            console.print(f"{r.spec}: per-layer plan (measured {r.bpv:.3f} bpv{calib}): " + "; ".join(
                f"L{i}:{_widths_label(p)}" for i, p in enumerate(r.plan)))
    summaries = summarize(runs, results) if len(runs) > len(args.codec) else []
    if summaries:
        seeds = Table(title=f"over k-means seeds 0..{args.seeds - 1} (codecs that draw none ran once)")
        for col in ("spec", "runs", "bpv", "kl mean", "kl min", "kl max", "top1 mean", "top1 min", "top1 max"):
            seeds.add_column(col, justify="left" if col == "spec" else "right", overflow="fold")
        for m in summaries:
            seeds.add_row(m.spec, str(m.runs), f"{m.bpv:.3f}", *(f"{x:.4f}" for x in (
                m.kl_mean, m.kl_min, m.kl_max, m.top1_mean, m.top1_min, m.top1_max)))
        console.print(seeds)
    meta = {"text": args.text, "skip": skip, "model": "SmolLM2-135M-Instruct", "settings": asdict(settings),
            "calibration": args.calibration if frozen else None, "plan_text": plan_path or None}
    if summaries:
        meta["seeds"] = [asdict(m) for m in summaries]
    if args.json:
        write_json(args.json, results, meta)
    if args.plot:
        pareto_plot(args.plot, results, f"{args.text}: quality per byte")
    return 0
