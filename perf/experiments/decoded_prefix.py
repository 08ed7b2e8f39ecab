"""The shared set-up of the long-context experiments: one text's exact run and its prefix through a codec.

`decoded_prefix` loads the shipped model, captures every layer's queries, keys and values over ``prefix + CONT``
tokens of ``text`` (after dropping its first ``skip``, as `kvbackend eval --skip` does), and reads the prefix back
through a `KVCache` of ``spec`` as `kvbackend eval` does.
"""
from dataclasses import dataclass

import torch

from kvbackend.depth import layer_specs
from kvbackend.geometry import Geometry
from kvbackend.rope import rotary_from_config
from kvbackend.tools.evaluate import Capture, EvalSettings, capture_exact, paged_reconstruction
from kvbackend.tools.models import load_model

CONT = 512  # continuation tokens scored, as `kvbackend eval`'s default


@dataclass
class DecodedPrefix:
    model: object
    ids: torch.Tensor  # [1, prefix + CONT]
    exact: Capture
    pre_k: list[torch.Tensor]  # per layer [prefix, H, D], as the cache reads them back
    pre_v: list[torch.Tensor]
    heads: int
    dim: int
    sink: int  # the spec's exact first tokens


def decoded_prefix(text: str, spec: str, prefix: int, skip: int) -> DecodedPrefix:
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    ids = tokenizer(open(text).read(), return_tensors="pt").input_ids[:, skip : skip + prefix + CONT]
    exact = capture_exact(model, ids)
    layers = len(exact.k)
    heads, _, dim = exact.k[0].shape
    geometry = Geometry(layers, heads, dim, exact.k[0].dtype)
    settings = EvalSettings(tokens=prefix, prefix=prefix, cont=CONT)
    pre_k, pre_v, _ = paged_reconstruction(layer_specs(spec, layers), exact, geometry, settings, prefix,
                                           rotary_from_config(model.config))
    sink = int(next((part.split("=")[1] for part in spec.replace(";", ",").split(",") if part.startswith("sink=")), 0))
    return DecodedPrefix(model, ids, exact, pre_k, pre_v, heads, dim, sink)
