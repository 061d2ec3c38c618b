"""Class names and prompt templates of the zero-shot protocol, shipped as data files of this package.

- `imagenet_class_names.json`: the 1000 curated ImageNet-1k class names OpenCLIP evaluates with, in label order
  (two names, "missile" and "sunglasses", occur twice, as in OpenCLIP's list).
- `imagenet_wnids.json`: the 1000 WordNet ids of ImageNet-1k, sorted; label i is wnid i.
- `prompt_templates.json`: `openai_imagenet` (the 80 templates of OpenAI's CLIP paper) and `simple_imagenet` (a
  subset of 7), as format strings with one `{}` for the class name.
"""

import functools
import importlib.resources
import json
from collections.abc import Sequence

from clip_jax.errors import InvalidInput, MissingInput

TEMPLATE_SETS = ("openai_imagenet", "simple_imagenet")


def _read_json(name: str):
    return json.loads(importlib.resources.files("clip_jax.evaluation").joinpath(name).read_text("utf-8"))


@functools.cache
def imagenet_class_names() -> tuple[str, ...]:
    return tuple(_read_json("imagenet_class_names.json"))


@functools.cache
def imagenet_wnids() -> tuple[str, ...]:
    return tuple(_read_json("imagenet_wnids.json"))


@functools.cache
def templates(name: str = "openai_imagenet") -> tuple[str, ...]:
    """A named set of prompt templates (see `TEMPLATE_SETS`)."""
    sets = _read_json("prompt_templates.json")
    if name not in sets:
        raise InvalidInput(f"unknown prompt template set {name!r}; choose one of {', '.join(sorted(sets))}, or give a "
                         "file of templates (a JSON list, or one template per line, each with one '{}')")
    return tuple(sets[name])


def readable_class_names(names: Sequence[str]) -> tuple[str, ...]:
    """ImageNet's curated class names when `names` are its 1000 wnids in label order, or ImageNet-V2's folder
    names `0` ... `999` (its label i is ImageNet's class i); otherwise `names`."""
    names = tuple(names)
    imagenet_v2 = tuple(str(i) for i in range(1000))
    return imagenet_class_names() if names in (imagenet_wnids(), imagenet_v2) else names


def check_templates(templates_: Sequence[str]) -> tuple[str, ...]:
    """Templates as a tuple, each holding exactly one `{}`."""
    templates_ = tuple(templates_)
    if not templates_:
        raise InvalidInput("no prompt templates given")
    bad = [t for t in templates_ if not isinstance(t, str) or t.count("{}") != 1]
    if bad:
        raise InvalidInput(f"prompt template {bad[0]!r} must contain exactly one '{{}}' where the class name goes")
    return templates_


def class_prompts(class_names: Sequence[str], templates_: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """Prompts [C][T]: every template filled with every class name."""
    templates_ = check_templates(templates_)
    return tuple(tuple(t.replace("{}", name) for t in templates_) for name in class_names)


def read_lines_or_json(path: str, what: str) -> tuple[str, ...]:
    """A list of strings from a `.json` file (a JSON list) or a text file (one entry per non-empty line)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise MissingInput(f"{what} file {path} does not exist") from None
    if path.endswith(".json"):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{what} file {path} is not valid JSON: {e}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise InvalidInput(f"{what} file {path} must hold a JSON list of strings")
        return tuple(items)
    return tuple(line.strip() for line in text.splitlines() if line.strip())
