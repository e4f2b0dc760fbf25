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

setup(packages=packages, package_dir=PACKAGE_DIRS, package_data={"epirl": ["py.typed"], "epirl.kernels.gemm": ["*.json"]})
