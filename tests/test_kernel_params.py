"""The launchers' ctypes mirrors of the CUDA kernels' `struct Params` lay out every field where nvcc does (CPU, with
nvcc for sm_90): a field added, dropped or moved on one side only would shift every later field the kernel reads.
Each check compiles the kernel's source with a static_assert per field (its offset) and on the struct's size."""

import ctypes
import subprocess

import pytest

from kvbackend.kernels import gather_cuda, mma_decode

pytestmark = pytest.mark.skipif(mma_decode.nvcc() is None, reason="nvcc not installed")


def _layout_asserts(params: type) -> str:
    lines = [f'static_assert(offsetof(Params, {name}) == {getattr(params, name).offset}, "{name}");'
             for name, _ in params._fields_]
    return "\n".join(lines + [f'static_assert(sizeof(Params) == {ctypes.sizeof(params)}, "size");'])


def _compiles(source, defines, params: type, tmp_path) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "layout.cu"
    wrapper.write_text(f'#include "{source}"\n#include <cstddef>\n{_layout_asserts(params)}\n')
    return subprocess.run([mma_decode.nvcc(), "-ptx", "-arch=sm_90", "-std=c++17", *defines, str(wrapper), "-o",
                           str(tmp_path / "layout.ptx")], capture_output=True, text=True)


DECODE = mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, rope_token=True, whole=1,
                           k_bits=3)
GATHER = gather_cuda.GatherConfig(64, 16, (2, 2, 16, 0, 0, 1, 4, 1), (1, 2, 64, 0, 0, 0, 1, 0), 2, 2, whole=2,
                                  outliers=4, rope=True)


@pytest.mark.parametrize("source,defines,params", [(mma_decode.SOURCE, DECODE.defines(), mma_decode._Params),
                                                   (gather_cuda.SOURCE, GATHER.defines(), gather_cuda._Params)],
                         ids=["decode", "gather"])
def test_params_mirror_the_kernel_struct(source, defines, params, tmp_path):
    done = _compiles(source, defines, params, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_mirror_with_a_field_dropped_fails_to_compile(tmp_path):
    class Short(ctypes.Structure):  # the decode mirror without its last field
        _fields_ = mma_decode._Params._fields_[:-1]

    done = _compiles(mma_decode.SOURCE, DECODE.defines(), Short, tmp_path)
    assert done.returncode != 0 and "whole_token" not in done.stderr  # the size, not a missing field's offset
    assert "size" in done.stderr
