"""What the absl entry points that take `--config` share: a mistaken flag is told in one line, exit status 2.

ml_collections checks `--config.FIELD=VALUE` overrides while absl parses the flags, before `main` runs, and a
field the config lacks surfaces there as a long traceback. `run` parses the flags itself, names the unknown field
and the closest one the config has, and exits 2 like every other user error (see clip_jax.errors).

A config file is plain Python that starts from the command's `default_config()` and sets fields, so a misspelled
field (`c.batchsize = 128`) would only add a field nobody reads. A command that names its defaults
(`expect_fields`) has every field its config file sets checked against them as the file loads, all named at once;
a file that is another command's config (every field it sets is that command's) is named as such, with the command.
"""

import difflib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

import ml_collections
from absl import app, flags

CONFIG_FLAG = "config"
USAGE_ERROR = 2
_DEFAULTS: dict[str, Callable[[], ml_collections.ConfigDict]] = {}  # config flag -> the command's default_config
_OTHERS: dict[str, Mapping[str, Callable[[], ml_collections.ConfigDict]]] = {}  # config flag -> {command: defaults}


def expect_fields(defaults: Callable[[], ml_collections.ConfigDict], config_flag: str = CONFIG_FLAG,
                  others: Mapping[str, Callable[[], ml_collections.ConfigDict]] | None = None) -> None:
    """Check the config file `--config_flag` loads against the fields `defaults()` has (see the module's docstring);
    `others`: the defaults of other commands (by their command line) whose configs are named as theirs."""
    _DEFAULTS[config_flag], _OTHERS[config_flag] = defaults, dict(others or {})


def run(main: Callable[[list[str]], object], config_flag: str = CONFIG_FLAG) -> None:
    """`absl.app.run(main)`, with flag mistakes (`--config.lrr=1`, `--config.lr=abc`) told in one line."""
    app.run(main, flags_parser=lambda argv: parse_flags(argv, config_flag))


def parse_flags(argv: Sequence[str], config_flag: str = CONFIG_FLAG) -> list[str]:
    """The arguments absl leaves for `main`; on a flag mistake, one line on stderr and exit status 2."""
    parser = flags.FLAGS[config_flag].parser
    load, loaded = parser.parse, []

    def load_and_keep(path):  # the loaded config, to check the overrides against when ml_collections fails
        if not os.path.isfile(path.split(":", 1)[0]):  # "file.py:arg" passes arg to get_config
            exit_with(f"--{config_flag}={path}: no such config file")
        loaded.append(load(path))
        if config_flag in _DEFAULTS:
            unknown = unknown_fields(loaded[-1], _DEFAULTS[config_flag]())
            owner = next((command for command, other in _OTHERS[config_flag].items()
                          if unknown and not unknown_fields(loaded[-1], other())), None)
            if owner:
                exit_with(f"--{config_flag}={path} is a config of {owner}: run it with {owner} --{config_flag}={path}")
            if unknown:
                exit_with(f"--{config_flag}={path} sets " + "; ".join(unknown) + ": fix the name in the file")
        return loaded[-1]

    parser.parse = load_and_keep
    try:
        return flags.FLAGS(list(argv))
    except flags.Error as e:  # a value of the wrong type, a missing or unknown flag
        exit_with(str(e).removeprefix("flag "))
    except (AttributeError, KeyError):  # ml_collections: an override of a field the config lacks
        message = loaded and unknown_field(loaded[-1], override_paths(argv, config_flag), config_flag)
        if not message:
            raise
        exit_with(message)
    finally:
        parser.parse = load


def exit_with(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def override_paths(argv: Sequence[str], config_flag: str) -> Iterator[str]:
    """The FIELD of each `--config.FIELD[=VALUE]` in `argv`."""
    for arg in argv[1:]:
        if arg == "--":
            return
        name = arg.lstrip("-").split("=", 1)[0]
        if arg.startswith("-") and name.startswith(config_flag + "."):
            yield name[len(config_flag) + 1:]


def unknown_field(config: ml_collections.ConfigDict, paths: Iterator[str], config_flag: str) -> str | None:
    """A line naming the first override in `paths` that `config` has no field for, and the closest field."""
    for path in paths:
        node = config
        for key in path.split("."):
            if not isinstance(node, ml_collections.ConfigDict):
                break  # inside a leaf value: ml_collections' own message is the one to give
            key = key.split("[", 1)[0]  # --config.field[0]=...
            if key not in node:
                close = difflib.get_close_matches(path, list(field_paths(config)), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                return f"--{config_flag}.{path}: no such config field{hint}"
            node = node[key]
    return None


def unknown_fields(config: ml_collections.ConfigDict | dict, defaults: ml_collections.ConfigDict) -> list[str]:
    """"FIELD, which is no config field (did you mean 'CLOSEST'?)" for each field of `config` (a config, or the
    fields of a saved `config.json`) that `defaults` lacks, nested ones where the default is itself a config."""
    known = list(field_paths(defaults))
    problems = []
    for path in field_paths(config):
        parent = path.rsplit(".", 1)[0] if "." in path else None
        if path in known or (parent is not None and parent not in known):
            continue  # known, or inside a field that is itself unknown (named once, as that field)
        close = difflib.get_close_matches(path, known, n=1)
        problems.append(f"{path}, which is no config field" + (f" (did you mean '{close[0]}'?)" if close else ""))
    return problems


def field_paths(config: ml_collections.ConfigDict | dict, prefix: str = "") -> Iterator[str]:
    """Every field of `config`, nested ones as dotted paths."""
    for key, value in config.items():
        yield prefix + key
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            yield from field_paths(value, f"{prefix}{key}.")
