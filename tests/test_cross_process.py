"""Two processes seeded alike (data-parallel ranks, or one engine restarted with the same seed) write
one file-tier directory; a third restores both prompts at once. Each prompt must read back exactly as
the process that wrote it saw it: chunk ids never repeat across processes, so no restored page joins
the codebook of another process's chunk."""

import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent("""
    import random, sys
    import torch
    from kvbackend import CacheConfig, Geometry, KVCache
    from kvbackend.tiers.file import FileTier
    from kvbackend.tiers.prefetch import TieredCache

    role, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
    random.seed(0)  # what an engine's set_seed does in every rank
    torch.manual_seed(0)
    geometry = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    cache = KVCache(geometry, CacheConfig(codec="qvg:centroids=4,group=16", page_size=4, chunk_pages=2,
                                          dense_pages=16, packed_pages=32))
    tiered = TieredCache(cache, None, FileTier(directory, 10**8, cache.fingerprint), background=False)
    prompts = {"a": list(range(100, 117)), "b": list(range(500, 517))}

    def reads(rid):
        return [cache.read_packed(rid, layer) for layer in range(2)]

    if role in prompts:  # a writer: its own prompt, K/V scaled so the two ranks' values differ
        rid, _ = cache.add_request(prompts[role])
        scale = 1.0 if role == "a" else 5.0
        for layer in range(2):
            cache.append(rid, layer, scale * torch.randn(17, 2, 16), scale * torch.randn(17, 2, 16))
        torch.save(reads(rid), out)
        cache.free(rid)
        assert tiered.offload(max_pages=100) == 4
        tiered.flush()
    else:  # the reader restores both prompts and keeps both resident
        got = {}
        for name, prompt in prompts.items():
            rid, hit = tiered.add_request(prompt)
            assert hit == 16, (name, hit)
            got[name] = reads(rid)
        cache.check()
        torch.save(got, out)
    tiered.close()
""")


def run(role, directory, out):
    done = subprocess.run([sys.executable, "-c", SCRIPT, role, str(directory), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_processes_seeded_alike_never_serve_each_others_pages(tmp_path):
    directory = tmp_path / "tier"
    for role in ("a", "b"):
        run(role, directory, tmp_path / f"{role}.pt")
    run("reader", directory, tmp_path / "reader.pt")
    got = torch.load(tmp_path / "reader.pt")
    for role in ("a", "b"):
        expected = torch.load(tmp_path / f"{role}.pt")
        for (k, v), (ek, ev) in zip(got[role], expected):
            assert torch.equal(k, ek) and torch.equal(v, ev), f"prompt {role} came back with other values"
