"""The seconds each test module took in a measured run of the suite, for tests/conftest.py's scheduling (longest
modules first). Refresh after tests change much:

    .venv/bin/python -m pytest -q -n 2 --dist loadfile tests --junitxml=/tmp/suite.xml
    .venv/bin/python tests/module_seconds.py /tmp/suite.xml

A stale table costs only balance between the two workers, never a test."""

import collections
import json
import os
import sys
import xml.etree.ElementTree as ElementTree

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


def read(junit_xml: str) -> dict[str, float]:
    """{test module file name: seconds of its tests (set-up, call and tear-down)} from pytest's JUnit XML."""
    seconds = collections.Counter()
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        module = next(part for part in case.attrib["classname"].split(".") if part.startswith("test_"))
        seconds[module + ".py"] += float(case.attrib.get("time", 0))
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda item: -item[1])}


def load() -> dict[str, float]:
    try:
        with open(TABLE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


if __name__ == "__main__":
    (path,) = sys.argv[1:]
    table = read(path)
    with open(TABLE, "w") as f:
        json.dump(table, f, indent=0)
        f.write("\n")
    print(f"{len(table)} modules, {sum(table.values()):.0f} s, written to {TABLE}")
