"""`python -m clip_jax.open_clip_train [OpenCLIP's flags]`: an OpenCLIP 3.3 launch line run by clip_jax, with only
`-m open_clip_train.main` (or `src/training/main.py`) replaced. The flags become a run config
(`clip_jax.interop.open_clip_config`, each flag's meaning in `clip_jax.interop.open_clip_flags.FLAGS`), printed on
stdout as one JSON object, then trained by the same run loop as `python -m clip_jax.train`. A no-op flag is one
`note:` line on stderr, a refused one an error line (exit 2).

    --dry-run                 print the config only: no process joins, no data is read (one device per process is
                              assumed for --workers, as OpenCLIP runs one process per GPU)
    --print-open-clip CONFIG  the other way: the OpenCLIP command line of a clip_jax config file, then the fields
                              that have no OpenCLIP flag
"""

import argparse
import importlib.util
import shlex
import sys
import time

import ml_collections

from clip_jax.errors import InvalidInput, MissingInput, UserError
from clip_jax.interop import open_clip_config, open_clip_flags
from clip_jax.runtime import entry, storage
from clip_jax.runtime.stop_signals import StopSignal
from clip_jax.training import command


def _own_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the run config as JSON and stop")
    p.add_argument("--print-open-clip", metavar="CONFIG", help="print a config file's OpenCLIP command line")


@entry.command(interrupts=False)  # the run takes stop signals itself: it saves, then stops
def main(argv=None, *, stop: StopSignal | None = None) -> int:
    args = open_clip_flags.parse(sys.argv[1:] if argv is None else argv, open_clip_flags.parser(_own_options))
    if args.print_open_clip:
        flags, unflagged = open_clip_config.command_line(load_config(args.print_open_clip))
        print(shlex.join(["python", "-m", "open_clip_train.main", *flags]))
        for line in unflagged:
            print(f"# no OpenCLIP flag: {line}")
        return 0
    for line in open_clip_config.notes(args):
        print(f"note: {line}", file=sys.stderr)
    config = open_clip_config.run_config(args)
    refuse_existing_run(config)
    if args.dry_run:
        complete(args, config, devices_per_process=1, stamp=time.time())
        return 0
    stop = stop or StopSignal()

    def after_joining(config: ml_collections.ConfigDict) -> None:
        import jax

        from clip_jax.runtime.processes import time_of_process_0

        complete(args, config, devices_per_process=jax.local_device_count(), stamp=time_of_process_0(),
                 show=jax.process_index() == 0)

    try:
        command.run_task(config, "pretraining", stop, complete=after_joining)
    except UserError as e:  # its way out in the flags this run was given
        e.args = (open_clip_config.in_open_clip_terms(str(e)),)
        raise
    return 0


def complete(args: argparse.Namespace, config: ml_collections.ConfigDict, *, devices_per_process: int,
             stamp: float, show: bool = True) -> None:
    """The config's per-process workers and OpenCLIP's run name (made from `stamp` without --name), then (`show`:
    process 0) the config printed as one JSON object."""
    config.workers = args.workers * devices_per_process
    config.name = config.name or open_clip_config.open_clip_name(args, stamp)
    if not show:
        return
    print(f"note: --workers {args.workers} per GPU x {devices_per_process} device(s) per process = workers "
          f"{config.workers}" + (" (assumed: one process per GPU)" if args.dry_run else ""), file=sys.stderr)
    print(config.to_json(), flush=True)


def refuse_existing_run(config: ml_collections.ConfigDict) -> None:
    """An existing run directory without --resume latest is refused, as OpenCLIP refuses it. Checked by every
    process before they join, so before any of them writes there."""
    directory = storage.join(config.logs, config.name)
    if config.name and config.resume != "latest" and storage.exists(directory):
        raise InvalidInput(f"experiment {directory} already exists: give another --name, or --resume latest to "
                           "continue it")


def load_config(path: str) -> ml_collections.ConfigDict:
    """The config a file's `get_config()` returns (the file as `--config` loads it; "file.py:arg" passes arg)."""
    path, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location("_open_clip_config_file", path)
    if spec is None or not path.endswith(".py"):
        raise InvalidInput(f"--print-open-clip {path}: give a config file (configs/*.py)")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise MissingInput(f"--print-open-clip {path}: no such config file") from None
    return module.get_config(arg) if arg else module.get_config()
