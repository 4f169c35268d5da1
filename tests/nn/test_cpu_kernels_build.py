"""Where the C++ kernels can be built, they are: the kernel tests skip on a failed build (the serving
path falls back to PyTorch), so a broken kernel source must fail here instead of skipping there."""

import os
import platform
import shutil

import pytest

from mlsyslab.nn import cpu_kernels


@pytest.mark.skipif(os.environ.get("MLSYS_CPU_KERNELS") == "0", reason="kernels switched off (MLSYS_CPU_KERNELS=0)")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "aarch64") or shutil.which("c++") is None,
                    reason="no C++ compiler or an architecture the kernels do not target")
def test_the_kernels_build_on_a_host_with_a_compiler():
    assert cpu_kernels.load() is not None
