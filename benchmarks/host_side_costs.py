"""The host-side costs some of kvserve's choices rest on, timed on the default model (best of --repeats):

    python benchmarks/host_side_costs.py [--model PATH] [--repeats 5] [--chars 20000]

1. A GGUF header: ``kvserve.formats.gguf.read_gguf_header`` against ``gguf.GGUFReader`` (why kvserve
   parses the header itself).
2. ``model_fingerprint``: sampled reads, so its cost does not grow with the model.
3. Tokenizing a long text with ``encode`` (holds the GIL) and ``encode_batch`` (lets go of it), the path
   ``Tokenizer.encode`` takes above ``LONG_TEXT_CHARS``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf

from kvserve.formats.gguf import read_gguf_header
from kvserve.model.loader import model_fingerprint, resolve_model_path
from kvserve.tokenizer import Tokenizer


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the packaged SmolLM2 GGUF)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chars", type=int, default=20000, help="length of the text to tokenize")
    args = parser.parse_args()
    path = Path(resolve_model_path(args.model))

    ours = best_of(args.repeats, lambda: read_gguf_header(path))
    theirs = best_of(max(1, args.repeats // 2), lambda: gguf.GGUFReader(path))
    print(f"GGUF header of {path.name}: read_gguf_header {ours * 1e3:.1f} ms, gguf.GGUFReader {theirs * 1e3:.1f} ms")

    fingerprint = best_of(args.repeats, lambda: model_fingerprint(path))
    print(f"model_fingerprint: {fingerprint * 1e3:.2f} ms for {path.stat().st_size / 2**20:.0f} MiB")

    backend = Tokenizer.from_model_path(path)._backend
    text = ("The quick brown fox jumps over the lazy dog; 12345 " * (args.chars // 50 + 1))[: args.chars]
    held = best_of(args.repeats, lambda: backend.encode(text))
    released = best_of(args.repeats, lambda: backend.encode_batch([text]))
    same = backend.encode(text).ids == backend.encode_batch([text])[0].ids
    print(f"tokenize {len(text)} chars: encode {held * 1e3:.2f} ms, encode_batch {released * 1e3:.2f} ms "
          f"({released / held:.2f}x, same ids: {same})")


if __name__ == "__main__":
    main()
