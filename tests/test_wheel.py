"""The wheel installs preprocess/, rewards/ and sim/ as omni_rl subpackages."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

IMPORT_CHECK = """
import sys
target = sys.argv[1]
import omni_rl, omni_rl.preprocess, omni_rl.rewards, omni_rl.sim
import omni_rl.preprocess.video
for module in (omni_rl, omni_rl.preprocess, omni_rl.rewards, omni_rl.sim):
    assert module.__file__.startswith(target), module.__file__
print("ok")
"""


@pytest.mark.slow
def test_wheel_installs_the_three_subpackages(tmp_path):
    # Build from a copy of the tracked files: a build in the checkout would leave a
    # build/ folder whose stale files a later build could package.
    source = tmp_path / "source"
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [wheel] = wheels.glob("omni_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"omni_rl"}, tops
    assert "omni_rl/preprocess/video.py" in names
    assert "omni_rl/rewards/__init__.py" in names and "omni_rl/sim/__init__.py" in names

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    # Only the target and the venv's third-party packages, not the editable install's
    # finder (.pth files run only with site) and not the source tree (cwd elsewhere).
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PYTHONPATH": f"{target}:{site_packages}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-S", "-c", IMPORT_CHECK, str(target)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
