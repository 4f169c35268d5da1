"""Notices of the slow first-time steps — the C++ kernels' build, a GGUF file's conversion — on stderr.

Library code logs them at INFO on the `mlsyslab` logger, which prints nothing unless asked (a library's manners);
`show()` prints that logger's records on stderr as bare lines. The CLI and the serving engine's process call it, so
a first `mlsys serve` says what its minute or two of start-up is doing instead of staying silent.
"""

from __future__ import annotations

import functools
import logging
import sys

LOGGER = "mlsyslab"


@functools.cache  # once per process: a second handler would print every notice twice
def show() -> None:
    """Print the `mlsyslab` logger's INFO records and above on stderr, one bare line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
