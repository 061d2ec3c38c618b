"""Runs the README's ```python blocks in order, as one reader would type them into one fresh interpreter after
`import clip_jax`: each top-level statement in turn, in one namespace. A name a statement reads that nothing before
it defined is one of the README's inputs (`images`, `state_dict`, ...): its fixture, from `fixtures.json`, runs just
before that statement. A name with no fixture fails the run, naming the README line.

Usage: python readme_blocks.py README.md FIXTURES.json   (in the folder the README's relative paths name)."""

import ast
import builtins
import json
import sys
import time

import clip_jax  # noqa: F401  (the README's snippets run after it)


def python_blocks(readme: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, its code) for every ```python block."""
    blocks, lines = [], readme.splitlines()
    for start, line in enumerate(lines):
        if line.strip() == "```python":
            end = lines.index("```", start + 1)
            blocks.append((start + 2, "\n".join(lines[start + 1:end])))
    return blocks


def free_names(statement: ast.stmt) -> set[str]:
    """Names `statement` reads that it does not bind itself (comprehension variables, lambda arguments, ...)."""
    read, bound = set(), set()
    for node in ast.walk(statement):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


def run(readme_path: str, fixtures: dict[str, str], substitutions: list[list[str]]) -> None:
    """Runs the blocks; each `[written, instead]` substitution replaces what the README's blocks write (a LAION
    path, a batch of 86,016) with what this machine can run."""
    with open(readme_path) as f:
        blocks = python_blocks(f.read())
    for written, instead in substitutions:
        if not any(written in code for _, code in blocks):
            sys.exit(f"no README block writes {written!r} any more: update the substitution")
        blocks = [(line, code.replace(written, instead)) for line, code in blocks]
    namespace: dict = {"__name__": "__readme__"}
    for first_line, code in blocks:
        start = time.perf_counter()
        module = ast.parse(code)
        ast.increment_lineno(module, first_line - 1)
        for statement in module.body:
            for name in sorted(free_names(statement) - namespace.keys()):
                if name not in fixtures:
                    sys.exit(f"README.md:{statement.lineno} reads {name!r}, which no earlier block defines "
                             "and no fixture gives")
                exec(fixtures[name], namespace)
            exec(compile(ast.Module([statement], type_ignores=[]), readme_path, "exec"), namespace)
        print(f"block at README.md:{first_line} ran: {len(module.body)} statements, "
              f"{time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        given = json.load(f)
    run(sys.argv[1], given["fixtures"], given["substitutions"])
    print("all blocks ran")
