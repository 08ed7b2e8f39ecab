"""The serving runner (`kvbackend.tools.llama_runner`): chunked prefill and batched decode through the
paged cache give the model's own logits (identity codec) and stay close with a lossy one."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvbackend import CacheConfig, Geometry, KVCache  # noqa: E402
from kvbackend.rope import rotary_from_config  # noqa: E402
from kvbackend.tools.llama_runner import LlamaRunner, merge_new_token  # noqa: E402
from kvbackend.tools import step_graphs  # noqa: E402
from kvbackend.tools.step_graphs import bucket  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def runner(model, codec, backend="auto"):  # on CUDA the Triton kernels
    geometry = Geometry(2, 2, 32, torch.float32)
    cache = KVCache(geometry, CacheConfig(codec=codec, page_size=16, chunk_pages=2, dense_pages=32,
                                          packed_pages=64, device=DEVICE, backend=backend),
                    rotary=rotary_from_config(model.config))
    return LlamaRunner(model, cache)


def reference(model, ids):
    with torch.no_grad():
        return model(ids[None].to(DEVICE), use_cache=False).logits[0]


@pytest.mark.parametrize("codec,tol", [("identity", 1e-4), ("kivi:bits=4,group=16,sink=2,pagerope=true", 0.05)])
def test_chunked_prefill_and_batched_decode_give_the_models_logits(model, codec, tol):
    torch.manual_seed(1)
    prompts = [torch.randint(0, 256, (n,)) for n in (75, 40)]
    run = runner(model, codec)
    ids, last = [], []
    for prompt in prompts:  # chunked prefill: 32 tokens at a time, chunks completing in between
        rid, _ = run.cache.add_request()
        for start in range(0, len(prompt), 32):
            logits = run.prefill(rid, prompt[start:start + 32])
        want = reference(model, prompt)[-1]
        assert float((logits - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))
        ids.append(rid)
        last.append(int(logits.argmax()))
    seqs = [prompt.tolist() + [token] for prompt, token in zip(prompts, last)]
    for _ in range(5):  # greedy decode of both requests in one batch
        logits = run.decode(ids, torch.tensor([s[-1] for s in seqs]))
        for i, seq in enumerate(seqs):
            want = reference(model, torch.tensor(seq))[-1]
            assert float((logits[i] - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))
            seq.append(int(want.argmax()))  # teacher-forced by the exact run, so errors do not compound
    assert all(run.cache.page_table(rid).packed for rid in ids)  # chunks were packed on the way
    run.cache.check()


def test_the_runner_refuses_a_cache_of_another_shape(model):
    cache = KVCache(Geometry(3, 2, 32, torch.float32), CacheConfig(codec="identity", page_size=16, device=DEVICE))
    with pytest.raises(ValueError, match="does not fit the model"):
        LlamaRunner(model, cache)
    run = runner(model, "identity")
    rid, _ = run.cache.add_request()
    with pytest.raises(ValueError, match="prefill first"):
        run.decode([rid], torch.tensor([1]))


def test_bad_input_is_refused_with_a_clear_error(model):
    run = runner(model, "identity")
    rid, _ = run.cache.add_request()
    for bad, match in ((torch.tensor([], dtype=torch.long), "at least one"), (torch.tensor([300]), "token ids")):
        with pytest.raises(ValueError, match=match):
            run.prefill(rid, bad)
    run.prefill(rid, torch.tensor([1, 2, 3]))
    for ids, tokens in (([], torch.tensor([], dtype=torch.long)), ([rid], torch.tensor([1, 2]))):
        with pytest.raises(ValueError, match="one token id per request"):
            run.decode(ids, tokens)
    with pytest.raises(ValueError, match="token ids"):
        run.decode([rid], torch.tensor([-1]))
    assert run.cache.page_table(rid).lengths == [3, 3]  # nothing was appended by the refused calls
    g = run.cache.geometry
    run.cache.append_step([rid], 0, torch.zeros(1, g.num_kv_heads, g.head_dim, device=DEVICE),
                          torch.zeros(1, g.num_kv_heads, g.head_dim, device=DEVICE))  # a step cut after layer 0
    for call in (lambda: run.decode([rid], torch.tensor([1])), lambda: run.prefill(rid, torch.tensor([1]))):
        with pytest.raises(ValueError, match="partial step"):
            call()
    assert run.cache.page_table(rid).lengths == [4, 3]


@pytest.mark.parametrize("shift", [0.0, 60.0, -60.0])  # the stored tokens' scores far above or below the new token's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_the_new_token_is_attention_over_all_tokens(shift, dtype):
    torch.manual_seed(3)
    b, h, g, d, n, scale = 3, 2, 3, 16, 7, 0.25
    q = torch.randn(b, h * g, d).to(dtype)
    keys, values = torch.randn(b, n, h, d), torch.randn(b, n, h, d)
    k, v = torch.randn(b, h, d).to(dtype), torch.randn(b, h, d).to(dtype)
    qf = q.float().view(b, h, g, d)
    stored = torch.einsum("bhgd,bnhd->bhgn", qf, keys) * scale + shift  # the stored tokens' scores, shifted
    out = torch.einsum("bhgn,bnhd->bhgd", stored.softmax(-1), values).reshape(b, h * g, d)
    lse = stored.logsumexp(-1).reshape(b, h * g)
    scores = torch.cat([stored, (qf * k.float()[:, :, None]).sum(-1, keepdim=True) * scale], -1)
    everything = torch.cat([values, v.float()[:, None]], 1)
    want = torch.einsum("bhgn,bnhd->bhgd", scores.double().softmax(-1), everything.double()).reshape(b, h * g, d)
    got = merge_new_token(out.to(dtype), lse, q, k, v, scale)
    assert got.dtype == torch.float32 and got.shape == (b, h * g, d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the stored output's own rounding
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    if shift:  # one side holds all the weight: the result is the other side's values exactly, not a blend
        side = out.to(dtype).float() if shift > 0 else v.float().repeat_interleave(g, 1)
        torch.testing.assert_close(got, side, atol=1e-6, rtol=0)


def test_graph_steps_pad_batches_to_a_few_sizes():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 46)] == [1, 2, 4, 8, 8, 16, 16, 24, 48]
    with pytest.raises(ValueError, match="at least one request"):
        bucket(0)


def test_cuda_graphs_are_refused_for_a_rope_that_changes_with_the_length():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, num_hidden_layers=1, vocab_size=64,
                                      max_position_embeddings=256,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(config).eval()
    cache = KVCache(Geometry(1, 1, 32, torch.float32), CacheConfig(codec="identity", page_size=16, device="cpu"))
    with pytest.raises(ValueError, match="dynamic"):
        LlamaRunner(model, cache, cuda_graphs=True)
    LlamaRunner(model, cache)  # eager steps read the frequencies each step


@pytest.mark.skipif(DEVICE == "cuda", reason="the refusal is for a model off CUDA")
def test_cuda_graphs_are_refused_off_cuda(model):
    run = runner(model, "identity")
    with pytest.raises(ValueError, match="CUDA device"):
        LlamaRunner(model, run.cache, cuda_graphs=True)


class Rerun:
    """Stands in for a captured graph off CUDA: replaying runs the piece again and writes its outputs into the
    static tensors, so the replay's orchestration (padding, order, copies) is tested on any device."""

    def __init__(self, piece, outputs):
        self.piece, self.outputs = piece, outputs

    def replay(self):
        result = self.piece()
        for static, tensor in zip(self.outputs, result if isinstance(result, tuple) else (result,)):
            static.copy_(tensor)


def emulated_capture(run, batch):
    state = step_graphs.static_state(run, batch)
    step_graphs.run_pieces(run, state, None)
    layers = len(run.layers)
    state.graphs = [Rerun(piece, (state.queries[i], state.keys[i], state.values[i]) if i < layers else (state.logits,))
                    for i, piece in enumerate(step_graphs.pieces(run, state))]
    return state


@pytest.mark.parametrize("mode", ["emulated", pytest.param("cuda", marks=pytest.mark.skipif(DEVICE != "cuda",
                                                                                         reason="CUDA graphs"))])
@pytest.mark.parametrize("codec", ["identity", "kivi:bits=4,group=16,sink=2,pagerope=true",
                                   "quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true"])
def test_graph_steps_give_the_eager_steps_logits_and_pages(model, codec, mode, monkeypatch):
    """Batches that change size and order (padded sizes 4, 2, 4, 1, 4): the replayed steps give the eager
    steps' logits and leave the same pages; returned logits are copies, unchanged by later steps."""
    torch.manual_seed(2)
    prompts = [torch.randint(0, 256, (n,)) for n in (75, 40, 19)]
    eager, graphs = runner(model, codec), runner(model, codec)
    if mode == "cuda":
        graphs = LlamaRunner(model, graphs.cache, cuda_graphs=True)
    else:
        monkeypatch.setattr(step_graphs, "capture", emulated_capture)
        graphs.cuda_graphs = True
    ids = []
    for prompt in prompts:
        rid, _ = eager.cache.add_request()
        assert graphs.cache.add_request()[0] == rid
        eager.prefill(rid, prompt)
        graphs.prefill(rid, prompt)
        ids.append(rid)
    kept = []
    for batch in ([0, 1, 2], [0, 2], [2, 0, 1], [1], [1, 2, 0]):
        rids = [ids[i] for i in batch]
        tokens = torch.randint(0, 256, (len(rids),))
        want, got = eager.decode(rids, tokens), graphs.decode(rids, tokens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        kept.append((got, got.clone()))
    assert sorted(graphs._graphs) == [1, 2, 4]  # one capture per padded size
    for got, copy in kept:
        assert torch.equal(got, copy)
    for rid in ids:
        assert graphs.cache.page_table(rid).lengths == eager.cache.page_table(rid).lengths
        for layer in range(2):
            for a, b in zip(eager.cache.gather(eager.cache.plan([rid], layer), layer),
                            graphs.cache.gather(graphs.cache.plan([rid], layer), layer)):
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    graphs.cache.check()


@pytest.mark.parametrize("mode", ["eager", "emulated", pytest.param("cuda", marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="CUDA graphs"))])
def test_a_chunk_packed_in_the_middle_of_a_step_does_not_stall_the_batch(model, mode, monkeypatch):
    """A chunk completed while the packed pool was full waits in the dense pool; once room is made, the next
    step's first append packs it, so the step's plan is stale for the layers after: the runner plans them again
    (it raised there, and the batch stayed one token ahead in layer 0 for good). The Triton backend's paths on
    every machine (its interpreter off CUDA)."""
    torch.manual_seed(4)
    cache = KVCache(Geometry(2, 2, 32, torch.float32),
                    CacheConfig(codec="identity", page_size=16, chunk_pages=2, dense_pages=16, packed_pages=2, backend="triton",
                                device=DEVICE), rotary=rotary_from_config(model.config))
    run = LlamaRunner(model, cache, cuda_graphs=mode == "cuda")
    if mode == "emulated":
        monkeypatch.setattr(step_graphs, "capture", emulated_capture)
        run.cuda_graphs = True
    prompts = [torch.randint(0, 256, (n,)) for n in (33, 40, 5)]
    a, b, c = (cache.add_request()[0] for _ in prompts)
    for rid, prompt in zip((a, b, c), prompts):
        run.prefill(rid, prompt)
    assert not cache.page_table(b).packed  # its chunk is complete, its packing put off: the pool is full
    cache.free(a)
    seqs = [prompts[2].tolist(), prompts[1].tolist()]
    for _ in range(2):
        tokens = torch.randint(0, 256, (2,))
        logits = run.decode([c, b], tokens)
        for i, seq in enumerate(seqs):
            seq.append(int(tokens[i]))
            want = reference(model, torch.tensor(seq))[-1]
            # (float32 pages through the Triton kernels, which sum in their own order: 1.1e-4 off seen at worst)
            torch.testing.assert_close(logits[i], want, atol=3e-4, rtol=3e-4)
    assert cache.page_table(b).packed  # packed during the first step
    assert cache.page_table(b).lengths == [42, 42] and cache.page_table(c).lengths == [7, 7]
    cache.check()
