"""Other packages' internals: the versions they were read in are checked as `clip_jax.runtime.private_apis` is
imported, and a package outside them fails that import in one line naming the package and the range."""

import os
import subprocess
import sys

import pytest

from clip_jax.runtime import private_apis
from clip_jax.runtime.private_apis import IncompatibleVersion, check_versions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_installed_versions_are_those_the_internals_were_read_in():
    installed = private_apis.installed_versions()
    assert set(installed) == set(private_apis.WRITTEN_FOR)  # all three are dependencies of clip_jax
    check_versions(installed)


@pytest.mark.parametrize("version", ["0.13.0", "0.12.7", "1.0.0rc1"])
def test_a_version_outside_the_range_is_one_line_naming_the_package_and_the_range(version):
    with pytest.raises(IncompatibleVersion) as error:
        check_versions({"jax": "0.10.2", "orbax-checkpoint": version})
    assert str(error.value) == (f"orbax-checkpoint {version} is installed, but clip_jax relies on internals of "
                                "orbax-checkpoint >=0.12.8,<0.13: pip install 'orbax-checkpoint>=0.12.8,<0.13'")


def test_versions_within_the_range_and_packages_not_installed_pass():
    check_versions({"jax": "0.10.9", "orbax-checkpoint": "0.12.8", "grain": "0.2.99+local"})
    check_versions({})
    assert private_apis.release("0.13.0rc1") == (0, 13, 0)


@pytest.mark.subprocess
def test_importing_the_storage_under_another_grain_fails_in_one_line(tmp_path):
    # a distribution's metadata found first on the path is the version importlib.metadata reports
    (tmp_path / "grain-0.4.1.dist-info").mkdir()
    (tmp_path / "grain-0.4.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: grain\nVersion: 0.4.1\n")
    done = subprocess.run([sys.executable, "-c", "import clip_jax.runtime.storage"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}, cwd=REPO,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "clip_jax.runtime.private_apis.IncompatibleVersion: grain 0.4.1 is installed, but clip_jax relies on "
        "internals of grain >=0.2.18,<0.3: pip install 'grain>=0.2.18,<0.3'"), done.stderr
