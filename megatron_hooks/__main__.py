"""``python -m megatron_hooks {apply,revert,status,drift} --megatron-dir DIR``.

Exit status: 0 when the command did what was asked (for ``drift``: every pinned
function has a validated fingerprint), 1 on drift or a tree that is not patched
(``status``), 2 when the command could not run (bad directory, a conflict, a file of
the tree that cannot be read, written or parsed), with one line saying why.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_hooks import fingerprint, patching


def _drift(args: argparse.Namespace) -> int:
    pins = fingerprint.registered_pins()
    if not pins:
        print(
            f"no pins registered (entry-point group {fingerprint.PINS_ENTRY_POINT_GROUP}): install the plugin "
            "(pip install -e .) so its pins can be found",
            file=sys.stderr,
        )
        return 2
    findings = fingerprint.check_tree(pins, str(fingerprint.source_root(args.megatron_dir)))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "function": f.pin.qualname,
                        "status": f.status,
                        "fingerprint": f.fingerprint,
                        "file": f.file,
                        "line": f.line,
                    }
                    for f in findings
                ],
                indent=1,
            )
        )
    else:
        width = max(len(f.pin.qualname) for f in findings)
        print(f"{'function':<{width}}  status         fingerprint       validated on")
        for f in findings:
            print(
                f"{f.pin.qualname:<{width}}  {f.status:<13}  {f.fingerprint or '-':<16}  {', '.join(f.validated_on) or '-'}"
            )
        for f in findings:
            if not f.good:
                print(f"\nDRIFT: {f.explain()}")
    return 0 if all(f.good for f in findings) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hooks", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("apply", "apply the patch series (idempotent)"),
        ("revert", "remove the patch series"),
        ("status", "say whether the tree carries the hooks"),
        ("drift", "check the plugin's pinned upstream functions in a tree"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--megatron-dir", required=True, help="a Megatron-LM tree, or a dir holding megatron/")
        if name in ("apply", "revert"):
            sub.add_argument("--patches", default=str(patching.DEFAULT_PATCHES_DIR), help="the series directory")
        if name == "drift":
            sub.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "apply":
            print(patching.apply(args.megatron_dir, args.patches))
        elif args.command == "revert":
            print(patching.revert(args.megatron_dir, args.patches))
        elif args.command == "status":
            current = patching.status(args.megatron_dir)
            print(current.describe())
            return 0 if current.state == "patched" else 1
        else:
            return _drift(args)
    except (patching.PatchError, fingerprint.TreeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # What the tree's files can do to us: exit 2 (could not run), never 1 ("not patched", drift).
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else "a source file of the tree"
        print(f"error: {where} is not valid Python ({exc.msg}); nothing was changed", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(
            f"error: a source file of the tree is not UTF-8 text ({exc.reason}); nothing was changed", file=sys.stderr
        )
        return 2
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
