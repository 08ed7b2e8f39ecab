"""`kvbackend eval` with every chunk's k-means seeded cold (k-means++ from the chunk itself) instead of warm-started
from the previous chunk's centroids: a probe of whether warm starts are what makes the recommended spec's KL at a
6144-token prefix of code 1.4-2.6x its 1536-token figure (three chunks, two of them warm, against one cold chunk).

    python perf/experiments/cold_chunks_eval.py eval --text FILE --prefix 6144 --seeds 3 --codec SPEC --json OUT

The query statistics (PSAC, QSAC) are kept; only the states' centroids are dropped before each encode."""

import sys

from kvbackend.codecs import base
from kvbackend.tools.cli import main

_encode, _encode_units = base.Codec.encode, base.Codec.encode_units


def _cold(states):
    for state in states or ():
        if state is not None:
            state.centroids.clear()


def encode(self, k, v, layout, state=None):
    _cold([state])
    return _encode(self, k, v, layout, state)


def encode_units(self, k, v, layout, states=None, encoder=None):
    _cold(states)
    return _encode_units(self, k, v, layout, states, encoder)


base.Codec.encode, base.Codec.encode_units = encode, encode_units
sys.exit(main(sys.argv[1:]))
