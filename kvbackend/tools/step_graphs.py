"""A decode step's model work replayed as CUDA graphs, piecewise around the cache (as serving engines do).

Everything a decode step runs besides the cache (embedding, norms, projections, RoPE, the new token's
merge, MLPs, logits) is captured once per padded batch size into ``layers + 1`` graphs: graph 0 runs up to
layer 0's attention, graph ``l`` from layer ``l - 1``'s attention output to layer ``l``'s, the last one to
the logits. Between them the cache runs eagerly: `KVCache.decode` reads the pages (its plan changes every
step) and `KVCache.append_step` stores the step's keys and values (its pages are allocated on the host).

Batches are padded to a few sizes (`bucket`); padded rows compute on stale inputs and are never read: every
operation of the captured work is row-wise (projections, norms, RoPE, merge), so they cannot reach the
batch's rows.

As with any CUDA graph, the replays read the model's parameters at the addresses they had when captured: change
weights in place (``param.data.copy_``), or make a new runner after replacing a module or a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def bucket(batch: int) -> int:
    """The padded batch size a step of ``batch`` requests replays: powers of two to 8, then multiples of 8."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one request, got {batch}")
    return 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8


@dataclass
class StepGraphs:
    """Static inputs and outputs of one padded batch size's graphs (see the module's docstring)."""

    batch: int
    tokens: torch.Tensor                 # [batch] token ids (input)
    positions: torch.Tensor              # [batch, 1] positions of the step's tokens (input)
    queries: list[torch.Tensor]          # per layer [batch, Hq, D] (outputs of graph l)
    keys: list[torch.Tensor]             # per layer [batch, H, D]
    values: list[torch.Tensor]           # per layer [batch, H, D]
    outputs: list[torch.Tensor]          # per layer [batch, Hq, D] attention over the stored tokens (input)
    lse: list[torch.Tensor]              # per layer [batch, Hq] float32 (input)
    logits: torch.Tensor | None = None   # [batch, vocab] (output of the last graph)
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)


def static_state(runner, batch: int) -> StepGraphs:
    """Zeroed static inputs for a padded ``batch`` (outputs and graphs come from `capture`)."""
    weight = runner.model.model.embed_tokens.weight
    device, dtype, layers = weight.device, weight.dtype, len(runner.layers)
    return StepGraphs(batch, torch.zeros(batch, dtype=torch.long, device=device),
                      torch.zeros(batch, 1, dtype=torch.long, device=device), [], [], [],
                      [torch.zeros(batch, runner.heads, runner.head_dim, dtype=dtype, device=device)
                       for _ in range(layers)],
                      [torch.zeros(batch, runner.heads, dtype=torch.float32, device=device) for _ in range(layers)])


def capture(runner, batch: int) -> StepGraphs:
    """Capture ``runner``'s decode work for a padded ``batch`` (``runner``: a `LlamaRunner` on CUDA)."""
    state = static_state(runner, batch)
    device = state.tokens.device
    side = torch.cuda.Stream(device)  # warm-up on a side stream: library handles and workspaces exist before capture
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run_pieces(runner, state, None)
    torch.cuda.current_stream(device).wait_stream(side)
    run_pieces(runner, state, torch.cuda.graph_pool_handle())
    return state


def pieces(runner, state: StepGraphs) -> list:
    """The step's work between the cache's calls, in order: piece 0 from the tokens to layer 0's queries, keys
    and values, piece ``l`` from layer ``l - 1``'s attention to layer ``l``'s, the last to the logits. Each
    reads ``state``'s tensors and returns its outputs (a piece carries the hidden states to the next)."""
    model, layers = runner.model, len(runner.layers)
    carried = {}

    def piece(layer):
        if layer == 0:
            h = model.model.embed_tokens(state.tokens.view(state.batch, 1))
            carried["cos_sin"] = model.model.rotary_emb(h, state.positions)
        else:
            h = runner.post_attention(layer - 1, carried["h"], state.outputs[layer - 1], state.lse[layer - 1],
                                      state.queries[layer - 1], state.keys[layer - 1], state.values[layer - 1])
        carried["h"] = h
        return runner.logits(h[:, 0]) if layer == layers else runner.pre_attention(layer, h, *carried["cos_sin"])

    return [lambda layer=layer: piece(layer) for layer in range(layers + 1)]


def run_pieces(runner, state: StepGraphs, pool) -> None:
    """Run the pieces in order (``pool`` None) or capture each into a graph of ``pool``; their outputs become
    ``state``'s (tensors a later piece reads stay referenced, so the pool never hands them out again)."""
    state.queries, state.keys, state.values, state.graphs = [], [], [], []
    for layer, piece in enumerate(pieces(runner, state)):
        if pool is None:
            result = piece()
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                result = piece()
            state.graphs.append(graph)
        if layer == len(runner.layers):
            state.logits = result
        else:
            for kept, tensor in zip((state.queries, state.keys, state.values), result):
                kept.append(tensor)


def replay(runner, state: StepGraphs, request_ids: list[int], token_ids: torch.Tensor, lengths: list[int]):
    """One decode step of ``request_ids`` (at most ``state.batch``) through the graphs; returns a copy of the
    logits ``[B, vocab]`` (the static ones change at the next step)."""
    b = len(request_ids)
    state.tokens[:b].copy_(token_ids.view(b))
    state.positions[:b, 0].copy_(torch.tensor(lengths))
    plan = runner.cache.plan(request_ids, 0)  # every layer holds the same tokens until its own append
    state.graphs[0].replay()
    for layer in range(len(runner.layers)):
        q, k, v = state.queries[layer][:b], state.keys[layer][:b], state.values[layer][:b]
        plan, out, lse = runner.cache_layer(plan, request_ids, layer, q, k, v)
        state.outputs[layer][:b].copy_(out)
        state.lse[layer][:b].copy_(lse)
        state.graphs[layer + 1].replay()
    return state.logits[:b].clone()
