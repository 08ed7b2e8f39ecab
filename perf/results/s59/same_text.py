"""Whether two versions of `kernels/mma_decode.cu` compile to the same machine code (the `.text` section of each
cubin, sm_90) for a list of configurations: evidence that a source edit left a GPU-validated variant unchanged
when no GPU run is left to show it.

    python perf/results/s59/same_text.py OLD_COMMIT [NEW_FILE]
"""

import os
import struct
import subprocess
import sys
import tempfile

BASE = ["-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-use_fast_math", "-DPAGE=64", "-DMINB=2"]
CONFIGS = [  # the K_CHW defaults the first call of session 59 ran, then the package's other paths
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=1 -DV_KIND=0 -DK_CHW=1 -DCHW_BLOCK=2816",
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=1 -DV_KIND=0 -DK_CHW=1 -DCHW_BLOCK=2816 -DSINK=4 -DVROT=1",
    "-DHEAD_DIM=64 -DKG=1 -DVG=1 -DK_KIND=1 -DV_KIND=0 -DK_CHW=1 -DCHW_BLOCK=1024 -DNSTAGE=1 -DNWARPS=2",
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=0 -DV_KIND=0 -DK_CHAN=1",
    "-DHEAD_DIM=128 -DKG=2 -DVG=2 -DK_KIND=0 -DV_KIND=0",
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=0 -DV_KIND=0 -DK_CHAN=1 -DROPE_TOKEN=1 -DK_CENT=4 -DPSAC_R=4 "
    "-DPSAC_ROWS=16 -DPSAC_SPARSE=1 -DPSAC_FOLD=1 -DSINK=4 -DVROT=1 -DKBITS=3",
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=0 -DV_KIND=0 -DK_CHAN=1 -DPAGE_ROPE=1 -DOUT_N=8 -DK_CENT=4 -DSINK=4",
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=0 -DV_KIND=0 -DK_CHAN=1 -DROPE_TOKEN=1 -DK_CENT=32 -DWHOLE_N=2 -DKBITS=4 "
    "-DOUT_N=16 -DOUT_FOLD=1",
    # session 60's K_CHW defaults (the shared fold, subnormal pairs)
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=1 -DV_KIND=0 -DK_CHW=1 -DCHW_BLOCK=2816 -DCHW_SFOLD=1 -DCHW_SUBN=1",
    "-DHEAD_DIM=128 -DKG=1 -DVG=1 -DK_KIND=1 -DV_KIND=0 -DK_CHW=1 -DCHW_BLOCK=2816 -DCHW_SFOLD=1 -DCHW_SUBN=1 -DSINK=4 "
    "-DVROT=1",
]


def sections(path: str) -> dict[str, bytes]:
    b = open(path, "rb").read()
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", b, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * entsize) for i in range(count)]
    at = heads[names][4]
    return {b[at + h[0] : b.index(b"\0", at + h[0])].decode(): b[h[4] : h[4] + h[5]] for h in heads}


def main(old: str, new: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        # both sources compiled from paths of the same length: the path reaches the machine code of some variants
        # (the rotated-values builds differ between `kernels/mma_decode.cu` and `old.cu` with the same text)
        src = {"old": os.path.join(tmp, "old.cu"), "new": os.path.join(tmp, "new.cu")}
        with open(src["old"], "w") as f:
            f.write(subprocess.run(["git", "show", f"{old}:kernels/mma_decode.cu"], capture_output=True, text=True,
                                   check=True).stdout)
        with open(new) as f, open(src["new"], "w") as g:
            g.write(f.read())
        same = True
        for config in CONFIGS:
            text = {}
            for name, path in src.items():
                out = os.path.join(tmp, f"{name}.cubin")
                subprocess.run(["nvcc", *BASE, *config.split(), "-o", out, path], capture_output=True, check=True)
                text[name] = sections(out)[".text.mma_decode"]
            print(f"{'same' if text['old'] == text['new'] else 'DIFFERENT'} ({len(text['new'])} bytes): {config}")
            same &= text["old"] == text["new"]
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "kernels/mma_decode.cu"))
