"""The ``pdserve`` command: a thin dispatcher.

Each sub-command lives in the module that owns it and imports its heavy dependencies
(torch, ray, grpc) inside the function, so ``pdserve --help`` stays fast.
User errors print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from bench import compare as bench_compare
from bench import engine as bench_engine
from bench import kv_transfer as bench_kv_transfer
from bench import offline as bench_offline
from bench import serve as bench_serve
from deploy import generate_cmd, serve_cmd, status_cmd
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
app.command("status")(status_cmd.command)
bench_app.command("engine")(bench_engine.command)
bench_app.command("offline")(bench_offline.command)
bench_app.command("kv-transfer")(bench_kv_transfer.command)
bench_app.command("serve")(bench_serve.command)
bench_app.command("compare")(bench_compare.command)
eval_app.command("ppl")(eval_perplexity.command)


def main() -> None:
    try:
        app(standalone_mode=False)
    except (UserError, InvalidRequest) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("pdserve: aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
