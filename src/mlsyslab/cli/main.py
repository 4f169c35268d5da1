"""`mlsys`: the command line. predict, plan and zoo today; run and verify build on them.

Every command takes `--json` (then prints exactly one JSON object on stdout). Bad input prints one
line on stderr naming the field, the value and what is valid, and exits with code 2.
"""

import sys

import typer

try:  # typer >= 0.26 vendors click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer uses click itself
    from click.exceptions import UsageError

from mlsyslab.cli import (audit_commands, measure_commands, predict_commands, primer_commands, scenario_commands,
                          schedule_commands, serve_commands, train_commands, walls_commands, zoo_commands)
from mlsyslab.errors import MlsysError
from mlsyslab.progress import show as show_progress

app = typer.Typer(
    name="mlsys", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="mlsyslab: predict, run and verify ML systems — from a laptop to a cluster.",
)
predict_app = typer.Typer(no_args_is_help=True, help="First-principles predictions (numpy only, instant).")
predict_app.command("train")(predict_commands.predict_train)
predict_app.command("serve")(predict_commands.predict_serve)
predict_app.command("roofline")(predict_commands.predict_roofline)
predict_app.command("fleet")(scenario_commands.fleet_command)
predict_app.command("ops")(scenario_commands.ops_command)
predict_app.command("kv-paging")(scenario_commands.kv_paging_command)
predict_app.command("speculative")(scenario_commands.speculative_command)
predict_app.command("reasoning")(scenario_commands.reasoning_command)
predict_app.command("prune")(scenario_commands.prune_command)
predict_app.command("queue")(scenario_commands.queue_command)
predict_app.command("prefix-cache")(scenario_commands.prefix_cache_command)
predict_app.command("disaggregate")(scenario_commands.disaggregate_command)
predict_app.command("data")(walls_commands.predict_data)
predict_app.command("scaling")(walls_commands.predict_scaling)
predict_app.command("quantize")(walls_commands.predict_quantize)
predict_app.command("moe-imbalance")(walls_commands.predict_moe_imbalance)
predict_app.command("wafer")(walls_commands.predict_wafer)
app.add_typer(predict_app, name="predict")
app.command("plan")(predict_commands.plan_command)
app.command("sensitivity")(scenario_commands.sensitivity_command)
app.command("search")(scenario_commands.search_command)
app.command("audit")(audit_commands.audit_command)
app.command("explain")(walls_commands.explain_command)
app.command("train")(train_commands.train_command)
app.command("schedule")(schedule_commands.schedule_command)
app.command("serve")(serve_commands.serve_command)
app.command("generate")(serve_commands.generate_command)
bench_app = typer.Typer(no_args_is_help=True, help="Load tests against servers.")
bench_app.command("serve")(serve_commands.bench_serve_command)
app.add_typer(bench_app, name="bench")
app.command("calibrate")(measure_commands.calibrate_command)
app.command("primer")(primer_commands.primer_command)
zoo_app = typer.Typer(no_args_is_help=True, help="The catalog: accelerators, systems and models.")
zoo_app.command("hardware")(zoo_commands.zoo_hardware)
zoo_app.command("models")(zoo_commands.zoo_models)
app.add_typer(zoo_app, name="zoo")


def main() -> None:
    """Entry point: turn input errors (ours and the parser's) into one stderr line and exit code 2."""
    show_progress()
    try:
        exit_code = app(standalone_mode=False)  # not standalone, click returns a command's typer.Exit code
    except MlsysError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except UsageError as error:
        print(f"error: {error.format_message()}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        sys.exit(130)
    if isinstance(exit_code, int):
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
