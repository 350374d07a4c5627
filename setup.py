"""Package discovery: every package under ``omni_rl/``, and the top-level folders
``preprocess/``, ``rewards/`` and ``sim/`` as subpackages of ``omni_rl`` (their
``package-dir`` mapping is in pyproject.toml). A new subpackage is found without
editing a list."""

from setuptools import find_packages, setup

MAPPED = ("preprocess", "rewards", "sim")

packages = find_packages(include=["omni_rl", "omni_rl.*"])
for top in MAPPED:
    packages += [f"omni_rl.{name}" for name in find_packages(include=[top, f"{top}.*"])]

setup(packages=packages)
