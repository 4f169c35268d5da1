"""`mlsyslab.progress`: the library's first-time notices reach stderr once the CLI turns them on, once each."""

import subprocess
import sys


def test_shown_notices_print_once_each_as_bare_lines_and_unshown_ones_not_at_all():
    script = ("import logging; from mlsyslab.progress import show; log = logging.getLogger('mlsyslab.nn.x'); "
              "log.info('before'); show(); show(); log.info('converting a file'); log.debug('detail')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr == "converting a file\n" and done.stdout == ""
