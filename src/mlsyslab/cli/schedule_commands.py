"""`mlsys schedule NAME`: a pipeline schedule as data, simulated and drawn.

Each rank's list of actions (F/B of a microbatch, `.c` for model chunk c under interleaving), the bubble of the
simulated timeline beside the analytic one (predict.pipeline), the microbatches whose activations each rank holds
at once, PipeDream's weight versions, and the chart (PNG) or Chrome / Perfetto trace. It is the object
`mlsys train --pp` executes (parallel/schedules.py); `mlsys train --timeline` draws the executed one.
"""

from pathlib import Path
from typing import Annotated, Optional

import typer

from mlsyslab.cli.options import Json, check_greater_than_zero, check_output_file, check_positive, check_range
from mlsyslab.cli.render import console, emit_json, table
from mlsyslab.errors import InvalidValue

MAX_ACTIONS = 2**16  # forward and backward actions a schedule may have: each is simulated and listed (~30,000 a second)
MAX_STAGE_S = 1e9  # seconds of a stage's forward or backward (32 years)


def schedule_command(
    name: Annotated[str, typer.Argument(help="gpipe, 1f1b, interleaved or pipedream")],
    stages: Annotated[int, typer.Option("--stages", help="pipeline ranks p")] = 4,
    microbatches: Annotated[int, typer.Option("--microbatches", help="microbatches per step m")] = 8,
    interleave: Annotated[int, typer.Option(help="model chunks per rank v (interleaved)")] = 1,
    forward_s: Annotated[float, typer.Option("--forward", help="a stage's forward time (a chunk's is 1/v of it)")] = 1.0,
    backward_s: Annotated[float, typer.Option("--backward", help="a stage's backward time")] = 2.0,
    png: Annotated[Optional[Path], typer.Option(help="draw the timeline into this .png")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="write it as a Chrome / Perfetto trace (.json)")] = None,
    json: Json = False,
):
    """A pipeline schedule: each rank's actions, its simulated bubble against the analytic one, activations in flight."""
    check_positive(1024, stages=stages, interleave=interleave)
    check_positive(microbatches=microbatches)
    if stages * microbatches * interleave > MAX_ACTIONS:
        raise InvalidValue("--microbatches", microbatches, f"at most {MAX_ACTIONS // (stages * interleave)} with "
                           f"{stages} stages × {interleave} chunks (stages·microbatches·interleave <= {MAX_ACTIONS})")
    check_greater_than_zero(forward=forward_s, backward=backward_s)
    check_range("--forward", forward_s, 0, MAX_STAGE_S)  # their sums over a schedule must stay finite
    check_range("--backward", backward_s, 0, MAX_STAGE_S)
    for option, path, suffix in (("--png", png, ".png"), ("--trace", trace, ".json")):
        if path is not None:
            check_output_file(option, path, (suffix,))
    from mlsyslab.parallel.schedules import build, chrome_trace, render_png, timeline, weight_versions
    from mlsyslab.predict.pipeline import pipeline_bubble_fraction

    schedule = build(name, stages, microbatches, interleave)
    simulated = timeline(schedule, forward_s, backward_s)
    analytic = float(pipeline_bubble_fraction(stages, microbatches, interleave))
    actions = [[f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if interleave > 1 else "") for a in rank]
               for rank in schedule.actions]
    versions = weight_versions(schedule) if name == "pipedream" else None
    if png is not None:
        render_png(schedule, simulated, str(png))
    if trace is not None:
        trace.write_text(chrome_trace(simulated))
    if json:
        return emit_json({"schedule": name, "stages": stages, "microbatches": microbatches, "interleave": interleave,
                          "actions": actions, "bubble": {"simulated": simulated.bubble, "analytic": analytic},
                          "peak_in_flight": simulated.peak_in_flight, "makespan": simulated.makespan,
                          "weight_versions": versions})
    rows = [(str(rank), " ".join(actions[rank]), str(simulated.peak_in_flight[rank])) for rank in range(stages)]
    console.print(table(f"{name}: p={stages}, m={microbatches}" + (f", v={interleave}" if interleave > 1 else ""),
                        rows, ("rank", "actions in order", "activations held at most" + (" (chunks)" if interleave > 1 else ""))))
    console.print(f"bubble: {simulated.bubble:.1%} simulated (forward {forward_s:g}, backward {backward_s:g}), "
                  f"{analytic:.1%} analytic")
    if versions is not None:
        console.print("weight versions (updates applied before each microbatch's forward): "
                      + "; ".join(f"rank {r}: " + " ".join(str(versions[r][i]) for i in range(microbatches))
                                  for r in range(stages)))
    for path in (png, trace):
        if path is not None:
            console.print(f"wrote {path}")
