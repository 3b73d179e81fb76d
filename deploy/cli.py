"""The ``pdserve`` command: a thin dispatcher.

Each sub-command lives in the module that owns it and imports its heavy dependencies
(torch, ray, grpc) inside the function, so ``pdserve --help`` stays fast.
User errors print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer
from typer.exceptions import TyperException

from bench import ablate as bench_ablate
from bench import attention as bench_attention
from bench import compare as bench_compare
from bench import decoder_loop as bench_decoder_loop
from bench import engine as bench_engine
from bench import gpu_check as bench_gpu_check
from bench import int8_prefill as bench_int8_prefill
from bench import kv_transfer as bench_kv_transfer
from bench import offline as bench_offline
from bench import quant as bench_quant
from bench import peers as bench_peers
from bench import profile as bench_profile
from bench import router_tokenize as bench_router_tokenize
from bench import serve as bench_serve
from deploy import bench_soak
from bench import spec as bench_spec
from deploy import generate_cmd, plan_cmd, router_cmd, scale_cmd, serve_cmd, status_cmd
from engine.errors import UserError
from evals import perplexity as eval_perplexity
from proto.sampling import InvalidRequest

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="pdserve: disaggregated prefill/decode LLM serving.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (write JSON, print a table).")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(no_args_is_help=True, help="Quality evaluations (write JSON, print a table).")
app.add_typer(eval_app, name="eval")

app.command("generate")(generate_cmd.command)
app.command("serve")(serve_cmd.command)
app.command("router")(router_cmd.command)
app.command("status")(status_cmd.command)
app.command("plan")(plan_cmd.command)
app.command("scale")(scale_cmd.command)
app.command("profile")(bench_profile.command)
bench_app.command("engine")(bench_engine.command)
bench_app.command("attention")(bench_attention.command)
bench_app.command("decoder-loop")(bench_decoder_loop.command)
bench_app.command("offline")(bench_offline.command)
bench_app.command("quant")(bench_quant.command)
bench_app.command("int8-prefill")(bench_int8_prefill.command)
bench_app.command("kv-transfer")(bench_kv_transfer.command)
bench_app.command("serve")(bench_serve.command)
bench_app.command("compare")(bench_compare.command)
bench_app.command("peers")(bench_peers.command)
bench_app.command("gpu-check")(bench_gpu_check.command)
bench_app.command("spec")(bench_spec.command)
bench_app.command("ablate")(bench_ablate.command)
bench_app.command("soak")(bench_soak.command)
bench_app.command("router-tokenize")(bench_router_tokenize.command)
eval_app.command("ppl")(eval_perplexity.command)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every way it can fail on the user's input ends in one stderr line and a status."""
    try:
        # standalone_mode=False makes click *return* typer.Exit's code instead of raising it.
        status = app(args=argv, prog_name="pdserve", standalone_mode=False)
        if isinstance(status, int) and status != 0:
            sys.exit(status)
    except (UserError, InvalidRequest) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("pdserve: aborted", file=sys.stderr)
        sys.exit(130)
    except TyperException as e:  # typer's vendored click: UsageError, NoSuchOption, BadParameter, ...
        sys.exit(_show_usage_error(e))


def _show_usage_error(e: TyperException) -> int:
    """Print a usage error as one line: the message and the command's usage; returns the exit status.

    typer >= 0.29 vendors click (``typer._click``), so its errors are not ``click.ClickException``;
    all of them derive from ``typer.exceptions.TyperException`` and carry ``exit_code`` (2 for
    usage errors). "no arguments" prints the help text, as click does."""
    ctx = getattr(e, "ctx", None)
    if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
        print(ctx.get_help(), file=sys.stderr)
        return e.exit_code
    usage = " ".join(ctx.get_usage().split()) if ctx is not None else "Usage: pdserve [OPTIONS] COMMAND [ARGS]..."
    message = " ".join(e.format_message().split())
    help_cmd = ctx.command_path if ctx is not None else "pdserve"
    print(f"pdserve: error: {message} ({usage}; see '{help_cmd} --help')", file=sys.stderr)
    return e.exit_code


if __name__ == "__main__":
    main()
