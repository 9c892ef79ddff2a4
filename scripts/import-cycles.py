#!/usr/bin/env python3
"""Circles of imports between files of different modules, per crate: each source file's
`crate::a::b` and `super::` paths resolved to the file that defines the module they name,
then the strongly connected groups of that graph that span more than one top-level module
(a circle inside one module's own files is that module's business).

    scripts/import-cycles.py            # every crate; exit 1 when a circle spans modules
    scripts/import-cycles.py engine     # one crate's folder

Approximate by design (it reads paths, not Rust's name resolution): `use` of a re-exported
name counts against the module that re-exports it.
"""
import os
import re
import sys

CRATES = ["configs", "comm", "partition", "pipeline", "nn", "checkpoint", "models", "data",
          "engine", "autotune", "."]


def module_files(src):
    """module path (tuple) -> file, for every .rs file under src (tests excluded)."""
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            if rel and (rel[-1] == "tests" or rel[-1].endswith("_tests")):
                continue
            out[tuple(rel)] = path
    return out


def code_of(path):
    """The file's text before its test module."""
    text = open(path, encoding="utf-8").read()
    # a test module written inline (`#[cfg(test)] mod tests {`), not one declared (`mod x;`)
    cut = re.search(r"^\s*#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text, re.M)
    return text[: cut.start()] if cut else text


def targets(mod, text, modules):
    found = set()
    for m in re.finditer(r"\b(crate|super)((?:::[a-z_][a-z0-9_]*)+)", text):
        head, rest = m.group(1), m.group(2).split("::")[1:]
        base = [] if head == "crate" else list(mod[:-1])
        if head == "super" and not modules.get(mod, "").endswith("mod.rs"):
            base = list(mod[:-1])
        path = base + rest
        # the longest prefix that is a module
        while path and tuple(path) not in modules:
            path = path[:-1]
        if path and tuple(path) != mod:
            found.add(tuple(path))
    return found


def sccs(graph):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            out.append(group)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    crates = sys.argv[1:] or CRATES
    bad = 0
    for crate in crates:
        src = os.path.join(crate, "src")
        modules = module_files(src)
        graph = {m: targets(m, code_of(f), modules) for m, f in modules.items()}
        for group in sccs(graph):
            tops = {g[0] if g else "" for g in group}
            if len(group) > 1 and len(tops) > 1:
                bad += 1
                names = sorted("::".join(g) or "(root)" for g in group)
                print(f"{crate}: a circle over {len(group)} files: {', '.join(names)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
