"""kvbackend.tools: what is built on the cache rather than part of it.

The `kvbackend` command line (``cli``), the end-to-end demo (``demo``), the codec evaluator
(``evaluate``) with the sequence-level reconstruction it measures (``reconstruct``) and the per-layer
plan search behind ``auto:`` specs (``auto``), the preset codec table (``presets``) and the loader of
the shipped model (``models``). Tools may import the core and the integration adapters; the core
(kvbackend/*.py, codecs/, alignpred/, kernels/, tiers/) imports nothing from here
(tests/test_layering.py checks it).
"""
