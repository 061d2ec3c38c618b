"""What the README writes in Python works as written: every `clip_jax.X.Y(...)` it calls resolves after
`import clip_jax`, in a fresh interpreter (the test session has long imported everything)."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_calls() -> list[str]:
    """The dotted names the README calls: `clip_jax.models.init_variables(...)`, `clip_jax.create_model(...)`."""
    with open(os.path.join(REPO, "README.md")) as f:
        return sorted(set(re.findall(r"\b(clip_jax(?:\.[A-Za-z_]\w*)+)\(", f.read())))


def test_the_readme_calls_the_names_this_test_expects():
    names = readme_calls()
    for name in ("clip_jax.tokenizer.tokenize", "clip_jax.interop.convert.from_open_clip",
                 "clip_jax.models.init_variables", "clip_jax.create_model"):
        assert name in names


@pytest.mark.subprocess
@pytest.mark.slow
def test_every_name_the_readme_calls_resolves_after_import_clip_jax():
    names = readme_calls()
    code = ("import sys\nimport clip_jax\n"
            "light = 'jax' not in sys.modules\n"
            f"for name in {names!r}:\n"
            "    assert callable(eval(name)), name\n"
            "try:\n"
            "    clip_jax.interop.no_such_module\n"
            "except AttributeError as e:\n"
            "    print(light, e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # `import clip_jax` alone stays light; an unknown name is still an AttributeError
    assert done.stdout == "True module 'clip_jax.interop' has no attribute 'no_such_module'\n"
