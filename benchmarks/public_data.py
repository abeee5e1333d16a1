"""Small public datasets that Python packages carry inside their wheels, unpacked for the benchmarks.

    python benchmarks/public_data.py ml-100k [--cache DIR]

Prints the directory holding the dataset's files (``nestpipe ingest --raw DIR`` reads it, ``--format auto``), or
says why it is not there and exits 1. The wheel is fetched with ``pip download --no-deps`` (nothing is installed)
and the files are unpacked once into the cache; a benchmark that needs a dataset calls :func:`dataset` and skips
with its message when it returns None. The data stays under its publisher's terms (docs/datasets.md): it is never
copied into the repository.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional, Tuple

# name -> (the wheel's requirement, its folder holding the files, the files)
PACKAGED = {
    "ml-100k": ("recbole==1.2.1", "recbole/dataset_example/ml-100k/",
                ("ml-100k.inter", "ml-100k.item", "ml-100k.user")),
}
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nestpipe", "public-data")


def dataset(name: str, cache: str = DEFAULT_CACHE) -> Tuple[Optional[str], str]:
    """(directory of ``name``'s files, "") or (None, why it is not available)."""
    requirement, folder, files = PACKAGED[name]
    out = os.path.join(cache, name)
    record = os.path.join(out, "source.json")
    if os.path.exists(record):
        return out, ""
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement],
                           capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if p.returncode or not wheels:
            return None, f"{name}: `pip download --no-deps {requirement}` failed ({p.stderr.strip()[-300:]})"
        os.makedirs(out, exist_ok=True)
        digests = {}
        with zipfile.ZipFile(wheels[0]) as z:
            for f in files:
                data = z.read(folder + f)
                tmp_path = os.path.join(out, f + ".tmp")
                with open(tmp_path, "wb") as fh:
                    fh.write(data)
                os.replace(tmp_path, os.path.join(out, f))
                digests[f] = hashlib.sha256(data).hexdigest()
    with open(record + ".tmp", "w") as fh:
        json.dump({"requirement": requirement, "wheel": os.path.basename(wheels[0]), "sha256": digests}, fh, indent=1)
    os.replace(record + ".tmp", record)
    return out, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(PACKAGED))
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="where the files are unpacked")
    args = ap.parse_args()
    where, why = dataset(args.name, args.cache)
    if where is None:
        print(why, file=sys.stderr)
        return 1
    print(where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
