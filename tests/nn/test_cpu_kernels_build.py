"""Where the C++ kernels can be built, they are: the kernel tests skip on a failed build (the serving
path falls back to PyTorch), so a broken kernel source must fail here instead of skipping there."""

import logging
import os
import platform
import shutil
import time
from pathlib import Path

import pytest

from mlsyslab.nn import cpu_kernels


@pytest.mark.skipif(os.environ.get("MLSYS_CPU_KERNELS") == "0", reason="kernels switched off (MLSYS_CPU_KERNELS=0)")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "aarch64") or shutil.which("c++") is None,
                    reason="no C++ compiler or an architecture the kernels do not target")
def test_the_kernels_build_on_a_host_with_a_compiler():
    assert cpu_kernels.load() is not None


def test_a_first_build_says_so_on_the_mlsyslab_logger_and_a_built_one_does_not(tmp_path, monkeypatch, caplog):
    """The build takes a minute or two on a small machine: the first one logs where it builds (`mlsyslab.progress`
    prints it in the CLI), later loads of the built library log nothing. (torch's build is replaced by one that
    writes the library's file, so that nothing compiles here.)"""
    from torch.utils import cpp_extension

    def build(name, build_directory, **_):
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", build)
    with caplog.at_level(logging.INFO, logger="mlsyslab"):
        cpu_kernels.load.__wrapped__()
        cpu_kernels.load.__wrapped__()
    notices = [record.getMessage() for record in caplog.records if "C++ kernels" in record.getMessage()]
    assert len(notices) == 1 and str(tmp_path) in notices[0]


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, caplog):
    """torch's build waits forever on the lock file of a build that was killed; one older than a build could take is
    removed before building (the build replaced as above), one that could be a running build's is left to it."""
    from torch.utils import cpp_extension

    seen = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda build_directory, **_: seen.append(
        (Path(build_directory) / "lock").exists()))
    cpu_kernels.load.__wrapped__()  # makes the folder
    lock = next(tmp_path.iterdir()) / "lock"
    lock.touch()
    os.utime(lock, (0, time.time() - cpu_kernels.STALE_BUILD_LOCK_S - 60))
    with caplog.at_level(logging.WARNING, logger="mlsyslab"):
        cpu_kernels.load.__wrapped__()
    assert seen[-1] is False and "did not finish" in caplog.text
    lock.touch()
    cpu_kernels.load.__wrapped__()
    assert seen[-1] is True
