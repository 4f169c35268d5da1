"""The fork server the tests' ranks are forked from imports the trainer and the parallel package once, where each
rank would import them (~0.3 s a rank: tests/parallel took 130-136 s without, 116-117 s with, on 2 cores)."""

from mlsyslab.comm import fork_server

fork_server.preload(("mlsyslab.train.worker",))
