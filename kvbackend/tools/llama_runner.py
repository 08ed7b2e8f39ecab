"""A Llama-architecture model served from a `KVCache` the way a serving engine drives one.

The model's own modules (transformers' `LlamaForCausalLM`, any weights) compute the projections,
RoPE, MLPs and logits; every key and value lives in the paged cache only:

- prefill of a chunk of one request: the request's stored K/V are read with `KVCache.gather`, the
  chunk attends to them and causally to itself (SDPA), and the chunk's K/V are appended per layer;
- a decode step of a batch: `KVCache.decode` attends to the stored tokens (the Triton kernels on CUDA,
  the torch reference elsewhere), the new token joins by its log-sum-exp, and `KVCache.append_step`
  stores the batch's new K/V with one call per layer. With ``cuda_graphs=True`` the step's model work
  between the cache's calls replays as CUDA graphs (`kvbackend.tools.step_graphs`), as engines decode.

Queries go to the cache only for codecs that read them (``quantwm``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvbackend.manager import KVCache
from kvbackend.tools import step_graphs


def merge_new_token(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention over the stored tokens (``out [B, Hq, D]`` with its log-sum-exp ``lse [B, Hq]``) joined by one
    more token per request (``k``, ``v`` ``[B, H, D]``, ``q [B, Hq, D]`` the step's queries): float32
    ``[B, Hq, D]``. The new token's share is ``1 - w`` with ``w = exp(lse - logaddexp(lse, q . k * scale))``,
    so the merge is one ``lerp`` (few operations: the decode step launches these once per layer)."""
    b, hq, d = q.shape
    h = k.shape[1]
    s_new = (q.float().reshape(b, h, hq // h, d) * k.float().unsqueeze(2)).sum(-1).mul_(scale)  # [B, H, G]
    lse = lse.reshape(b, h, hq // h)
    w_old = (lse - torch.logaddexp(lse, s_new)).exp_().unsqueeze(-1)
    return torch.lerp(v.float().unsqueeze(2), out.float().reshape(b, h, hq // h, d), w_old).view(b, hq, d)


def _rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb


class LlamaRunner:
    """Chunked prefill and batched decode of a transformers Llama model over ``cache``.

    ``cache`` must match the model: one layer per decoder layer, its KV heads and head size.
    ``cuda_graphs``: replay each decode step's model work as CUDA graphs captured once per padded batch size
    (the cache's reads and appends run between them); the model must be on CUDA.
    """

    def __init__(self, model, cache: KVCache, cuda_graphs: bool = False) -> None:
        config = model.config
        self.model, self.cache = model, cache
        self.layers = model.model.layers
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        g = cache.geometry
        if (g.num_layers, g.num_kv_heads, g.head_dim) != (len(self.layers), self.kv_heads, self.head_dim):
            raise ValueError(f"the cache's geometry {g} does not fit the model ({len(self.layers)} layers, "
                             f"{self.kv_heads} KV heads, head_dim {self.head_dim})")
        self.queries = [codec.uses_queries for codec in cache.codecs]
        self.apply_rope = _rope()
        rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
        if cuda_graphs and "dynamic" in str(rope_type):  # (its frequencies change with the length, on the host)
            raise ValueError(f"cuda_graphs=True needs a RoPE fixed at capture; rope_type {rope_type!r} recomputes "
                             "its frequencies as sequences grow (use cuda_graphs=False)")
        if cuda_graphs and model.model.embed_tokens.weight.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        self.cuda_graphs = cuda_graphs
        self._graphs = {}  # padded batch size -> step_graphs.StepGraphs

    def _qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections of ``x [B, T, hidden]`` with RoPE: q ``[B, Hq, T, D]``, k and v ``[B, H, T, D]``."""
        attn = self.layers[layer].self_attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.apply_rope(q, k, cos, sin)
        return q, k, v

    def _block(self, layer: int, h: torch.Tensor, attend) -> torch.Tensor:
        """One decoder layer around ``attend(normed hidden states) -> [B, T, Hq * D]``."""
        return self._after_attention(layer, h, attend(self.layers[layer].input_layernorm(h)))

    def _after_attention(self, layer: int, h: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer from its attention output ``[B, T, Hq * D]``: the next hidden states."""
        block = self.layers[layer]
        h = h + block.self_attn.o_proj(attention)
        return h + block.mlp(block.post_attention_layernorm(h))

    def _lengths(self, ids: list[int]) -> list[int]:
        """The tokens each request holds, refusing one whose layers hold different lengths (a step cut after its
        first layers: running on would pull its layers further apart)."""
        lengths = []
        for rid in ids:
            held = self.cache.page_table(rid).lengths
            if min(held) != max(held):
                raise ValueError(f"request {rid} holds a partial step (lengths per layer differ: {held}); free it")
            lengths.append(held[0])
        return lengths

    def _check_tokens(self, token_ids: torch.Tensor, where: str) -> None:
        vocab = self.model.model.embed_tokens.num_embeddings
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
            raise ValueError(f"{where}: token ids must be in 0..{vocab - 1}")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(h))

    def cache_layer(self, plan, ids: list[int], layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The cache's part of a decode step's layer: attention of ``q`` over the stored tokens, then the step's
        ``k``, ``v`` appended. Returns (the plan for the next layers, output, lse).

        The step's one plan serves every layer (each holds the same tokens until its own append), unless an
        earlier layer's append packed a chunk: a chunk completed while the packed pool was full is packed by the
        first append after room was made, in the middle of a step, and its dense pages went back to the pool, so
        the plan's page ids are stale; the layer is planned again then."""
        if any(table.version != version for table, version, _ in plan.tables):
            plan = self.cache.plan(ids, layer)
        out, lse = self.cache.decode(plan, layer, q, scale=self.layers[layer].self_attn.scaling)
        self.cache.append_step(ids, layer, k, v, queries=q if self.queries[layer] else None)
        return plan, out, lse

    def pre_attention(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """A decode step's layer up to attention: the queries ``[B, Hq, D]``, keys and values ``[B, H, D]``."""
        q, k, v = self._qkv(layer, self.layers[layer].input_layernorm(h), cos, sin)
        return q[:, :, 0], k[:, :, 0], v[:, :, 0]

    def post_attention(self, layer: int, h: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A decode step's layer from the cache's attention (``out``, ``lse``) on: the next hidden states."""
        merged = merge_new_token(out, lse, q, k, v, self.layers[layer].self_attn.scaling)
        return self._after_attention(layer, h, merged.to(h.dtype).view(h.shape[0], 1, -1))

    @torch.no_grad()
    def prefill(self, request_id: int, token_ids: torch.Tensor) -> torch.Tensor:
        """Run ``token_ids [T]`` after what the request holds; returns the last token's logits ``[vocab]``."""
        cache = self.cache
        start, = self._lengths([request_id])
        n = token_ids.shape[0]
        self._check_tokens(token_ids, "prefill")
        if token_ids.dim() != 1 or n == 0:
            raise ValueError(f"prefill takes a 1-D tensor of at least one token id, got shape {tuple(token_ids.shape)}")
        device = self.model.model.embed_tokens.weight.device
        ids = token_ids.to(device)[None]
        h = self.model.model.embed_tokens(ids)
        positions = torch.arange(start, start + n, device=device)[None]
        cos, sin = self.model.model.rotary_emb(h, positions)
        mask = torch.arange(start + n, device=device)[None, :] <= positions[0, :, None]  # [T, start + T]

        for layer in range(len(self.layers)):
            def attend(x, layer=layer):
                q, k, v = self._qkv(layer, x, cos, sin)
                k_new, v_new = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, H, D]
                if start:
                    k_old, v_old = cache.gather(cache.plan([request_id], layer), layer)
                    keys = torch.cat([k_old.to(k_new.dtype), k_new])
                    values = torch.cat([v_old.to(v_new.dtype), v_new])
                else:
                    keys, values = k_new, v_new
                out = F.scaled_dot_product_attention(q, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                                     attn_mask=mask, scale=self.layers[layer].self_attn.scaling,
                                                     enable_gqa=True)
                queries = q[0].transpose(0, 1) if self.queries[layer] else None
                cache.append(request_id, layer, k_new, v_new, queries=queries)
                return out.transpose(1, 2).reshape(1, n, -1)

            h = self._block(layer, h, attend)
        return self.logits(h[0, -1])

    @torch.no_grad()
    def decode(self, request_ids: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
        """One token per request (each holding at least one token); returns logits ``[B, vocab]``."""
        ids = [int(rid) for rid in request_ids]
        if not ids or token_ids.numel() != len(ids):
            raise ValueError(f"decode takes one token id per request: {len(ids)} requests, {token_ids.numel()} ids")
        self._check_tokens(token_ids, "decode")
        lengths = self._lengths(ids)
        if min(lengths, default=1) < 1:
            raise ValueError("a decode step needs requests that hold at least one token (prefill first)")
        if self.cuda_graphs:
            size = step_graphs.bucket(len(ids))
            if size not in self._graphs:
                self._graphs[size] = step_graphs.capture(self, size)
            return step_graphs.replay(self, self._graphs[size], ids, token_ids, lengths)
        device = self.model.model.embed_tokens.weight.device
        h = self.model.model.embed_tokens(token_ids.to(device).view(len(ids), 1))
        cos, sin = self.model.model.rotary_emb(h, torch.tensor(lengths, device=device)[:, None])
        plan = self.cache.plan(ids, 0)  # every layer holds the same tokens until its own append below
        for layer in range(len(self.layers)):
            q, k, v = self.pre_attention(layer, h, cos, sin)
            plan, out, lse = self.cache_layer(plan, ids, layer, q, k, v)
            h = self.post_attention(layer, h, out, lse, q, k, v)
        return self.logits(h[:, 0])
