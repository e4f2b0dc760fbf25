"""Package discovery for the top-level `kernels/`, `rewards/`, `eval/` folders.

They install as `epirl.kernels`, `epirl.rewards`, `epirl.eval` (so nothing generic like `kernels`
lands in site-packages); pyproject.toml alone cannot list their sub-packages without repeating them.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {"epirl": "epirl", "epirl.kernels": "kernels", "epirl.rewards": "rewards", "epirl.eval": "eval"}

packages = []
for name, folder in PACKAGE_DIRS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

# the W8A16 tile table is read at import time from beside its module (kernels/w8a16/configs.py)
PACKAGE_DATA = {"epirl": ["py.typed"], "epirl.kernels.w8a16": ["*.json"]}

setup(packages=packages, package_dir=PACKAGE_DIRS, package_data=PACKAGE_DATA)
