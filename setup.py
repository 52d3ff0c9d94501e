"""Package layout (metadata is in pyproject.toml): `mtp` and its data folders as they are; the experiment layer
`eval/` installed as `mtp_eval`, with the Hydra configs `conf/` inside it as `mtp_eval/conf`."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent


def under(folder: str, name: str) -> list[str]:
    """`name` and a package name for every subfolder of `folder` (data-only folders included)."""
    return [name] + [f"{name}.{p.relative_to(ROOT / folder).as_posix().replace('/', '.')}"
                     for p in sorted((ROOT / folder).rglob("*")) if p.is_dir() and p.name != "__pycache__"]


setup(
    packages=find_namespace_packages(include=["mtp", "mtp.*"], exclude=["*.__pycache__"])
    + under("eval", "mtp_eval") + under("conf", "mtp_eval.conf"),
    package_dir={"mtp_eval": "eval", "mtp_eval.conf": "conf"},
)
