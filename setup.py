"""Package layout (metadata is in pyproject.toml): `mtp` and its data folders as they are; the experiment layer
`eval/` installed as `mtp_eval` (not its `results/`, the benchmarks' raw files, read from the repository), with the
Hydra configs `conf/` inside it as `mtp_eval/conf`."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent


def under(folder: str, name: str, skip: tuple[str, ...] = ()) -> list[str]:
    """`name` and a package name for every subfolder of `folder` (data-only folders included), except the
    subtrees `skip` (relative to `folder`) and folders whose names are not package names (`.hydra`)."""
    out = [name]
    for p in sorted((ROOT / folder).rglob("*")):
        rel = p.relative_to(ROOT / folder)
        if not p.is_dir() or rel.parts[0] in skip or any(not part.isidentifier() for part in rel.parts):
            continue
        out.append(f"{name}.{rel.as_posix().replace('/', '.')}")
    return out


setup(
    packages=find_namespace_packages(include=["mtp", "mtp.*"], exclude=["*.__pycache__"])
    + under("eval", "mtp_eval", skip=("results",)) + under("conf", "mtp_eval.conf"),  # results: raw benchmark data
    package_dir={"mtp_eval": "eval", "mtp_eval.conf": "conf"},
)
