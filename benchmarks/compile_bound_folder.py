"""Write a compile-bound solution folder: CUDA solutions that each need a build of their own.

A model's solution folder holds one CUDA extension per file, each built once (30-90 s of nvcc) before
the file is judged. pkb's shipped CUDA solutions share one extension among five of them, so they are
not such a folder. This writes ``--copies`` variants of each shipped CUDA solution that builds its own
extension (1 all-reduce, 2 all-gather by default): the same file with a comment added to its CUDA
source, so that each variant's extension hashes differently and is built cold, as a model's would be.
``--part i/n`` writes only the i-th of n equal parts (1-based), to time a long one-at-a-time arm in pieces.

    python benchmarks/compile_bound_folder.py OUT [--copies 6] [--part 1/2]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "pkb" / "solutions"
OWN_EXTENSION = ("1_allreduce_cuda_peer.py", "2_allgather_cuda_peer.py")  # each calls load_cuda on its own source
LOAD_CALL = re.compile(r"load_cuda\((\"[a-z_]+\"), CUDA_SRC,")


def variant(source: str, copy: int) -> str:
    text, found = LOAD_CALL.subn(rf'load_cuda(\1, CUDA_SRC + "\\n// compile-bound variant {copy}\\n",', source)
    if found != 1:
        raise SystemExit("the shipped file no longer calls load_cuda(NAME, CUDA_SRC, ...) once: update this script")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--copies", type=int, default=6)
    parser.add_argument("--part", default="1/1")
    args = parser.parse_args()
    index, parts = (int(n) for n in args.part.split("/"))
    files = [(name, copy) for copy in range(args.copies) for name in OWN_EXTENSION]
    share = -(-len(files) // parts)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, copy in files[(index - 1) * share:index * share]:
        (args.out / name.replace(".py", f"_v{copy}.py")).write_text(variant((SHIPPED / name).read_text(), copy))
    print(f"{args.out}: {len(list(args.out.glob('*.py')))} files")


if __name__ == "__main__":
    main()
