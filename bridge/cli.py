"""The command line: `python -m bridge run SCRIPT [ARGS...]` (and the `bridge` console script)."""

import argparse
import os
import runpy
import sys
import traceback

DEVICES = ("auto", "cpu", "gpu", "tpu")
MODES = ("captured", "eager")


def _parser():
    parser = argparse.ArgumentParser(
        prog="bridge",
        description="Run unmodified PyTorch programs on JAX/XLA.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a PyTorch script under the bridge",
        description=(
            "Run SCRIPT as __main__ with its own arguments, as `python SCRIPT ARGS` would, with torch's "
            "'cuda' device mapped onto JAX. Options for the bridge go before SCRIPT; everything after it "
            "is the script's own argv."
        ),
    )
    run.add_argument(
        "--report", metavar="PATH", help="write the run report to PATH: a self-contained HTML page if PATH ends in .html, else JSON"
    )
    run.add_argument(
        "--strict",
        action="store_true",
        help=(
            "make every op that would fall back to eager torch on the CPU, or make its module run whole through "
            "torch.export, an error naming the op, the module and the calling line"
        ),
    )
    run.add_argument("--quiet", action="store_true", help="do not print the summary on stderr at exit")
    run.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="the JAX platform the script's 'cuda' device stands for (default: JAX's default backend)",
    )
    run.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help=(
            "captured (default): module calls, backward, gradient clipping and optimizer steps run as compiled "
            "XLA programs, cached by the structure of their inputs; eager: op by op "
            "(default: $BRIDGE_MODE, else captured)"
        ),
    )
    run.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help=(
            "start N processes of the script on this host, as torchrun does (RANK, LOCAL_RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT set for torch.distributed), each driving one device"
        ),
    )
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    compare = commands.add_parser(
        "compare",
        help="run a script with plain torch and under the bridge, and compare the numbers it prints",
        description=(
            "Run SCRIPT twice, as `python SCRIPT ARGS` and as `python -m bridge run SCRIPT ARGS`, and compare "
            "the numbers on the lines it prints (matched line by line). Exit code 0 when every number agrees "
            "within the tolerances, 1 otherwise."
        ),
    )
    compare.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    compare.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    compare.add_argument(
        "--match", metavar="REGEX", help="compare only lines matching REGEX (e.g. 'loss'; leave out timings)"
    )
    compare.add_argument("--device", choices=DEVICES, default="auto", help="as for `run`")
    compare.add_argument("--mode", choices=MODES, default=None, help="as for `run`")
    compare.add_argument("script", help="the Python script to run")
    compare.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    coverage = commands.add_parser(
        "coverage",
        help="measure op coverage against PyTorch's OpInfo/ModuleInfo databases and write the report",
        add_help=False,
    )
    coverage.add_argument("args", nargs=argparse.REMAINDER, help="options of the coverage report (--help)")
    check = commands.add_parser(
        "check",
        help="list a saved graph's ops (.pt2) by how the bridge would run each, without running it",
        description="Exit code 0 when every op runs on the bridge device, 1 when some would fall back to the CPU.",
    )
    check.add_argument("file", help="a torch.export program (.pt2)")
    convert = commands.add_parser(
        "convert",
        help="write a saved program as a standalone JAX module (jax and numpy only) or a StableHLO artifact",
        description=(
            "Write FILE (whatever bridge.load reads) as a Python module of jax.lax calls that needs neither torch "
            "nor the bridge, its parameters beside it, or with --to stablehlo as jax.export's serialization. "
            "Exit code 0 when written, 1 when the program cannot be written, 2 when FILE cannot be read."
        ),
    )
    convert.add_argument("file", help="a saved program: whatever bridge.load reads (a torch.export .pt2 file, ...)")
    convert.add_argument("-o", "--output", help="the file to write (default: FILE's name with _jax.py, or .stablehlo)")
    convert.add_argument(
        "--to", choices=("jax", "stablehlo"), default="jax", help="jax (default): a Python module; stablehlo: jax.export's bytes"
    )
    convert.add_argument(
        "--input", dest="inputs", action="append", metavar="SHAPE:DTYPE",
        help="an input's shape and dtype (e.g. 1x3x224x224:float32), once per input in order, where FILE does not record them",
    )
    convert.add_argument("--platforms", help="with --to stablehlo: platforms to lower for, e.g. cpu,cuda (default: JAX's backend)")
    commands.add_parser(
        "doctor",
        help="print the torch, JAX and Python versions found, JAX's backend and devices, and what to install",
        description="Exit code 0 when everything fits, 1 with advice when something does not.",
    )
    return parser


def run_script(script, args, report=None, strict=False, quiet=False, device="auto", mode=None):
    """Run a script under the bridge as `python script args` would; returns the exit code."""
    import bridge
    from bridge import report as run_report

    path = os.path.abspath(script)
    if not os.path.exists(path):
        print(f"bridge: can't open file {script!r}: no such file", file=sys.stderr)
        return 2
    if report and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        stem, extension = os.path.splitext(report)
        report = f"{stem}.rank{os.environ.get('RANK', '0')}{extension}"
    problem = report and run_report.unwritable(report)
    if problem:
        print(f"bridge: --report {report}: {problem}", file=sys.stderr)
        return 2
    # Activate (and import the tables) before sys.path is the script's.
    try:
        bridge.activate(device=device, strict=strict, mode=mode)
    except bridge.BridgeError as error:
        print(f"bridge: {error}", file=sys.stderr)
        return 2
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(path)
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit_request:
        code = _exit_code(exit_request)
    except BaseException as error:  # noqa: BLE001 - reported like Python does, then a non-zero exit
        _print_user_traceback(error, path)
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
    finally:
        sys.stdout.flush()
        run_report.finish(report, quiet)
    if code and _joined_others():
        # The other ranks may be waiting for this one in a collective, and JAX's exit would wait
        # for them at its shutdown barrier (5 minutes) before the launcher heard of the failure
        # and stopped them: this process ends now, as a failed torch rank does.
        sys.stderr.flush()
        os._exit(code)
    return code


def _joined_others():
    from bridge.runtime import distributed

    world = distributed.world()
    return world is not None and world.size > 1


def launch(options):
    """`run --nproc-per-node N`: torchrun's launcher starts N processes of `bridge run SCRIPT`, on
    a free port of this host; a process that fails stops the others, and the exit code says so."""
    from torch.distributed import run as torchrun

    own = ["run", "--device", options.device]
    own += ["--strict"] * options.strict + ["--quiet"] * options.quiet
    own += ["--mode", options.mode] if options.mode else []
    own += ["--report", options.report] if options.report else []  # one file per rank (run_script)
    command = ["--standalone", f"--nproc-per-node={options.nproc_per_node}", "-m", "bridge", *own,
               options.script, *options.args]
    if not os.environ.get("BRIDGE_COORDINATOR"):
        # JAX's coordination service on a port found free, not blindly the one after the store's
        # (torchrun picks that one free, and the next may be taken: "Failed to start RPC server").
        os.environ["BRIDGE_COORDINATOR"] = f"localhost:{_free_port()}"
    try:
        torchrun.main(command)
    except SystemExit as exit_request:
        return _exit_code(exit_request)
    except Exception as error:  # torchrun's ChildFailedError: it has printed which rank failed and why
        print(f"bridge: {type(error).__name__}: one or more processes failed (above)", file=sys.stderr)
        return 1
    return 0


def _free_port():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _exit_code(exit_request):
    value = exit_request.code
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _print_user_traceback(error, path):
    """The traceback as Python would print it, without the runner's own frames above the script."""
    from bridge import tracebacks

    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    error.__traceback__ = tb or error.__traceback__
    dropped = not tracebacks.debugging() and tracebacks.without_bridge_frames(error)
    traceback.print_exception(type(error), error, error.__traceback__)
    if dropped:
        print(tracebacks.NOTE, file=sys.stderr)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["coverage"]:
        # Its options belong to compat.coverage (argparse's REMAINDER would refuse a leading --flag).
        return _coverage(argv[1:])
    options = _parser().parse_args(argv)
    if options.command == "run" and options.nproc_per_node > 1:
        return launch(options)
    if options.command == "run":
        return run_script(
            options.script,
            options.args,
            report=options.report,
            strict=options.strict,
            quiet=options.quiet,
            device=options.device,
            mode=options.mode,
        )
    if options.command == "convert":
        from bridge.convert import main as convert_main

        return convert_main(options)
    if options.command == "check":
        from bridge.check import main as check_main

        return check_main(options.file)
    if options.command == "doctor":
        from bridge.doctor import main as doctor_main

        return doctor_main()
    if options.command == "compare":
        from bridge.compare import compare_script

        return compare_script(
            options.script, options.args, rtol=options.rtol, atol=options.atol, match=options.match, device=options.device,
            mode=options.mode,
        )
    return 2


def _coverage(argv):
    # compat sits above bridge in the layers (it measures bridge's public API); the CLI is
    # the one place that reaches up, lazily, so that `python -m bridge coverage` exists.
    from bridge.compat.coverage import main as coverage_main

    return coverage_main(argv)


def console_main():
    sys.exit(main())
