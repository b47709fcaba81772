#!/usr/bin/env python3
"""Slim the working tree that travels to a GPU machine for the GPU check, and put it back.

The device tool copies this checkout's tree to the GPU machine: every tracked
file and every untracked file git does not ignore (what
``git ls-files --cached --others --exclude-standard`` lists), at most 64 MiB.
Four tracked weight files (``tests/fixtures/toy_pair/*/model.safetensors``,
``vllm_dspark/assets/smollm2/dspark/model.safetensors``, ``training/assets/smollm2/dflash/model.safetensors``)
make the tree about 86.5 MiB.
``scripts/gpu_check.py`` reads none of them: it needs the paths in its
``NEEDED`` (the build, ``vllm_dspark/ops``, ``tests/ops/markov_cases.py``, ...).
From the repository root::

    python scripts/device_tree.py size      # the travelling tree as the tool counts it
    python scripts/device_tree.py slim      # take the big files the check does not need off it
    # ... the device run of scripts/gpu_check.py ...
    python scripts/device_tree.py restore   # put everything back

``slim`` takes every tracked file over 1 MiB that is not under ``NEEDED`` of
``scripts/gpu_check.py`` (read from its source, not imported). Today those are
the four weight files. For each, it removes the file from the index only
(``git rm --cached``: the file stays on disk, as it is) and lists it in
``.git/info/exclude``, in a block it marks. So the file is neither tracked nor
untracked-not-ignored, and it does not travel. ``git status`` shows it as a
staged deletion (``D``) while the tree is slim. Do not commit then: the commit
would delete the weights. ``slim`` refuses when one of those files has staged
or unstaged changes, has an index flag (skip-worktree, assume-unchanged) or a
conflict, or when the tree is already slim. Before it changes anything it
writes ``.git/device-tree-slim.json``, with each file's index entry (mode,
blob, stage). When the tree is still over 64 MiB after it, it puts everything
back and fails.

``restore`` puts back each index entry the marker records (only where the path
is not in the index again already), removes the exclude block, then the marker.
It is idempotent, and it finishes the job after an interrupted ``slim`` or
``restore``. Without a marker, it reads the paths from the exclude block and
resets them to HEAD (``git reset``).

Exit status: 0 when done (``size``: when the tree fits), 1 when refused or over
the limit.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from subprocess import CalledProcessError, run

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # bytes of working tree the device tool carries
BIG = 2**20  # a tracked file over this, outside what the GPU check needs, stays home
MARKER = "device-tree-slim.json"  # under the git directory
SCHEMA = "device-tree-slim/1"
BEGIN = ("# >>> scripts/device_tree.py slim: kept off the device tree "
         "(`python scripts/device_tree.py restore` removes this block)")
END = "# <<< scripts/device_tree.py slim"
_ENV = {**os.environ, "GIT_LITERAL_PATHSPECS": "1"}  # a path is a path, never a glob


class Refused(Exception):
    pass


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def git(repo: Path, *args: str, input: bytes | None = None, check: bool = True) -> bytes:
    proc = run(["git", *args], cwd=repo, input=input, capture_output=True, env=_ENV)
    if check and proc.returncode != 0:
        raise CalledProcessError(proc.returncode, ["git", *args], proc.stdout, proc.stderr)
    return proc.stdout


def _zsplit(out: bytes) -> list[str]:
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def git_path(repo: Path, name: str) -> Path:
    return repo / git(repo, "rev-parse", "--git-path", name).decode().strip()


# ------------------------------------------------------------------ counting
def tree_sizes(repo: Path) -> dict[str, int]:
    """What the device tool sends: tracked plus untracked-not-ignored files, listed but deleted skipped."""
    sizes = {}
    for f in _zsplit(git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")):
        with contextlib.suppress(OSError):  # listed but deleted: does not travel
            sizes[f] = (repo / f).lstat().st_size  # a link travels as a link
    return sizes


def needed(repo: Path) -> tuple[str, ...]:
    """``NEEDED`` of scripts/gpu_check.py, read from its source (importing it would import torch)."""
    tree = ast.parse((repo / "scripts" / "gpu_check.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "NEEDED" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise Refused("scripts/gpu_check.py has no NEEDED: cannot tell what the GPU check reads")


def is_needed(path: str, need: tuple[str, ...]) -> bool:
    return any(path == n or path.startswith(n + "/") for n in need)


def candidates(repo: Path, need: tuple[str, ...]) -> list[str]:
    """Tracked files over BIG that the GPU check does not read."""
    out = []
    for f in sorted(set(_zsplit(git(repo, "ls-files", "-z", "--cached")))):
        try:
            size = (repo / f).lstat().st_size
        except OSError:
            continue
        if size > BIG and not is_needed(f, need):
            out.append(f)
    return out


# ------------------------------------------------------------------ the marker and the exclude block
def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_marker(repo: Path) -> dict | None:
    path = git_path(repo, MARKER)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        print(f"warning: {path} is not valid JSON; using the exclude block instead", file=sys.stderr)
        return {}
    return data if isinstance(data, dict) else {}


def _pattern(path: str) -> str:
    esc = "".join("\\" + c if c in "\\*?[" else c for c in path)
    if esc.endswith(" "):
        esc = esc[:-1] + "\\ "
    return "/" + esc  # anchored at the repository root: this file, nothing else


def _unpattern(line: str) -> str:
    out, i, s = [], 0, line[1:] if line.startswith("/") else line
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            i += 1
        out.append(s[i])
        i += 1
    return "".join(out)


def _block_span(text: str) -> tuple[int, int] | None:
    lines = text.splitlines(keepends=True)
    pos, start = 0, None
    for ln in lines:
        if start is None and ln.rstrip("\n") == BEGIN:
            start = pos
        pos += len(ln)
        if start is not None and ln.rstrip("\n") == END:
            return start, pos
    return (start, len(text)) if start is not None else None  # a block without its end: to the end


def block_paths(repo: Path) -> list[str] | None:
    path = git_path(repo, "info/exclude")
    text = path.read_text() if path.exists() else ""
    span = _block_span(text)
    if span is None:
        return None
    body = text[span[0]:span[1]].splitlines()
    return [_unpattern(ln) for ln in body if ln and not ln.startswith("#")]


def add_block(repo: Path, paths: list[str]) -> dict:
    path = git_path(repo, "info/exclude")
    existed = path.exists()
    text = path.read_text() if existed else ""
    sep = "\n" if text and not text.endswith("\n") else ""
    _write_atomic(path, text + sep + "\n".join([BEGIN, *map(_pattern, paths), END]) + "\n")
    return {"path": str(path.relative_to(repo)), "existed": existed, "added_newline": bool(sep)}


def remove_block(repo: Path, how: dict) -> bool:
    path = git_path(repo, "info/exclude")
    if not path.exists():
        return False
    text = path.read_text()
    span = _block_span(text)
    if span is None:
        return False
    before, after = text[:span[0]], text[span[1]:]
    if how.get("added_newline") and before.endswith("\n") and not after:
        before = before[:-1]
    text = before + after
    if not text and how.get("existed") is False:
        path.unlink()
    else:
        _write_atomic(path, text)
    return True


# ------------------------------------------------------------------ the commands
def cmd_size(repo: Path, top: int = 10) -> int:
    sizes = tree_sizes(repo)
    total = sum(sizes.values())
    marker = read_marker(repo)
    block = block_paths(repo)
    if marker is not None or block is not None:
        paths = (marker or {}).get("paths") or block or []
        state = f"SLIM ({len(paths)} files off the tree; `python scripts/device_tree.py restore` puts them back)"
    else:
        state = "normal"
    print(f"state: {state}")
    fits = total <= LIMIT
    print(f"travelling tree: {_mib(total)} ({total} bytes) in {len(sizes)} files; limit {_mib(LIMIT)}: "
          + ("fits" if fits else "OVER"))
    print(f"largest {min(top, len(sizes))}:")
    for f, s in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        print(f"  {_mib(s):>10}  {f}")
    if state == "normal":
        cands = candidates(repo, needed(repo))
        print(f"`slim` would take off {len(cands)} files ({_mib(sum(sizes.get(f, 0) for f in cands))}): tracked, "
              f"over {_mib(BIG)}, not read by the GPU check" + "".join(f"\n  {f}" for f in cands))
    return 0 if fits else 1


def _index_entries(repo: Path, paths: list[str]) -> list[str]:
    return _zsplit(git(repo, "ls-files", "-z", "--stage", "--", *paths))


def cmd_slim(repo: Path) -> int:
    marker, block = read_marker(repo), block_paths(repo)
    if marker is not None or block is not None:
        raise Refused(f"already slim ({git_path(repo, MARKER).relative_to(repo)} or the exclude block is there); "
                      "run `python scripts/device_tree.py restore` first")
    need = needed(repo)
    paths = candidates(repo, need)
    before = tree_sizes(repo)
    if not paths:
        total = sum(before.values())
        print(f"nothing to slim: no tracked file over {_mib(BIG)} outside what the GPU check needs; "
              f"tree {_mib(total)}")
        return 0 if total <= LIMIT else 1
    bad = [p for p in paths if "\n" in p]
    if bad:
        raise Refused(f"cannot list a path with a newline in .git/info/exclude: {bad}")
    git(repo, "update-index", "-q", "--refresh", check=False)  # stat-only changes are not changes
    staged = _zsplit(git(repo, "diff", "--cached", "--name-only", "-z", "--", *paths))
    unstaged = _zsplit(git(repo, "diff", "--name-only", "-z", "--", *paths))
    if staged or unstaged:
        raise Refused("these files have changes; commit them, or put them back with "
                      "`git restore --staged --worktree -- <path>`, then slim again:\n  "
                      + "\n  ".join(sorted(set(staged) | set(unstaged))))
    entries = _index_entries(repo, paths)
    flagged = [ln[2:] for ln in _zsplit(git(repo, "ls-files", "-z", "-v", "--", *paths)) if ln[0] != "H"]
    conflicted = [e.split("\t", 1)[1] for e in entries if e.split("\t", 1)[0].split()[2] != "0"]
    if flagged or conflicted or len(entries) != len(paths):
        raise Refused("these files have an index flag (skip-worktree / assume-unchanged) or a conflict; clear it "
                      "(`git update-index --no-skip-worktree --no-assume-unchanged -- <path>`) and slim again:\n  "
                      + "\n  ".join(sorted(set(flagged) | set(conflicted))))
    head = git(repo, "rev-parse", "--verify", "-q", "HEAD", check=False).decode().strip() or None
    marker_path = git_path(repo, MARKER)
    record = {
        "schema": SCHEMA, "state": "slimming", "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "head": head, "threshold_bytes": BIG, "needed": list(need), "paths": paths, "index": entries,
        "exclude": {"path": str(git_path(repo, "info/exclude").relative_to(repo))},
        "tree_bytes_before": sum(before.values()),
    }
    _write_atomic(marker_path, json.dumps(record, indent=1) + "\n")  # first: restore works from here on
    record["exclude"] = add_block(repo, paths)
    _write_atomic(marker_path, json.dumps(record, indent=1) + "\n")
    git(repo, "rm", "--cached", "-q", "--", *paths)
    after = tree_sizes(repo)
    left = [p for p in paths if p in after]
    total = sum(after.values())
    record.update(state="slim", tree_bytes_after=total)
    _write_atomic(marker_path, json.dumps(record, indent=1) + "\n")
    print(f"slim: took {len(paths)} files off the device tree (index only; they stay on disk, listed in "
          f"{record['exclude']['path']}):" + "".join(f"\n  {_mib(before[p]):>10}  {p}" for p in paths))
    print(f"travelling tree: {_mib(sum(before.values()))} -> {_mib(total)} ({total} bytes); limit {_mib(LIMIT)}")
    if left or total > LIMIT:
        print("still " + (f"travelling: {left}" if left else "over the limit") + "; putting everything back. "
              "Largest now:" + "".join(f"\n  {_mib(s):>10}  {f}" for f, s in
                                       sorted(after.items(), key=lambda kv: -kv[1])[:8]), file=sys.stderr)
        cmd_restore(repo)
        return 1
    print(f"marker: {marker_path.relative_to(repo)}. Do not commit while slim (`git status` shows the files as "
          "staged deletions). Afterwards: python scripts/device_tree.py restore")
    return 0


def cmd_restore(repo: Path) -> int:
    marker = read_marker(repo)
    block = block_paths(repo)
    if marker is None and block is None:
        print("not slim: nothing to restore")
        return 0
    marker = marker or {}
    in_index = set(_zsplit(git(repo, "ls-files", "-z", "--cached")))
    entries = [e for e in marker.get("index", []) if e.split("\t", 1)[1] not in in_index]
    if entries:  # each path back exactly as the marker recorded it (mode, blob, stage)
        git(repo, "update-index", "-z", "--index-info", input="".join(e + "\0" for e in entries).encode(
            "utf-8", "surrogateescape"))
    paths = marker.get("paths") or block or []
    missing = [p for p in paths if p not in in_index and not any(e.split("\t", 1)[1] == p for e in entries)]
    if missing:  # no marker (or one without entries): back to HEAD's entry
        git(repo, "reset", "-q", "--", *missing)
    if entries or missing:
        git(repo, "update-index", "-q", "--refresh", check=False)  # stat data for the entries put back
    removed = remove_block(repo, marker.get("exclude", {}))
    git_path(repo, MARKER).unlink(missing_ok=True)
    back = set(_zsplit(git(repo, "ls-files", "-z", "--cached")))
    lost = [p for p in paths if p not in back]
    print(f"restore: {len(entries) + len(missing)} index entries put back, "
          f"exclude block {'removed' if removed else 'already gone'}, marker removed")
    if lost:
        print(f"warning: not in the index after restore: {lost}", file=sys.stderr)
        return 1
    total = sum(tree_sizes(repo).values())
    print(f"travelling tree: {_mib(total)} ({total} bytes)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout (default: the one this script is in)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("size", help="the travelling tree's size, the largest files, and whether it is slim")
    p.add_argument("--top", type=int, default=10)
    sub.add_parser("slim", help="take the big files the GPU check does not need off the travelling tree")
    sub.add_parser("restore", help="undo slim (idempotent)")
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    try:
        if args.cmd == "size":
            return cmd_size(repo, args.top)
        return cmd_slim(repo) if args.cmd == "slim" else cmd_restore(repo)
    except Refused as e:
        print(f"{args.cmd}: refused: {e}", file=sys.stderr)
        return 1
    except CalledProcessError as e:
        print(f"{args.cmd}: {' '.join(e.cmd)} failed ({e.returncode}): {e.stderr.decode(errors='replace')}",
              file=sys.stderr)
        if args.cmd == "slim" and git_path(repo, MARKER).exists():
            print("the tree may be half slim: run `python scripts/device_tree.py restore`", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
