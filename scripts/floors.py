#!/usr/bin/env python3
"""The workspace's crates as floors: prints each crate's floor and the workspace crates it
depends on (normal, dev and build dependencies, from `cargo metadata`), and fails naming every
dependency that points from a lower floor to a higher one or across one floor.

    scripts/floors.py            # the graph, and exit 1 on an arrow against the floors
    scripts/floors.py --markdown # the same as the table ARCHITECTURE.md shows

Floors, lowest first (ARCHITECTURE.md, "The crate map"): a crate may import only crates on
floors below its own.
"""
import json
import subprocess
import sys

FLOORS = [
    ["ds-config"],
    ["ds-comm"],
    ["ds-partition", "ds-pipeline"],
    ["ds-nn"],
    ["ds-models", "ds-data", "ds-checkpoint"],
    ["ds-engine"],
    ["ds-autotune"],
    ["ds-rs"],
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def main():
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    ours = {p["name"] for p in meta["packages"]}
    unknown = sorted(ours - FLOOR.keys())
    bad = [f"{name}: a crate with no floor in scripts/floors.py" for name in unknown]
    rows = []
    for p in sorted(meta["packages"], key=lambda p: (FLOOR.get(p["name"], 99), p["name"])):
        deps = {}
        for d in p["dependencies"]:
            if d["name"] in ours:
                deps.setdefault(d["name"], set()).add(d["kind"] or "normal")
        for dep, kinds in deps.items():
            if FLOOR.get(dep, 99) >= FLOOR.get(p["name"], -1):
                bad.append(f"{p['name']} -> {dep} ({', '.join(sorted(kinds))}): not a lower floor")
        listed = ", ".join(
            dep + ("" if kinds == {"normal"} else f" ({', '.join(sorted(kinds))})")
            for dep, kinds in sorted(deps.items(), key=lambda d: FLOOR.get(d[0], 99))
        )
        rows.append((FLOOR.get(p["name"], 99), p["name"], listed or "-"))
    if "--markdown" in sys.argv:
        print("| floor | crate | depends on (workspace crates) |")
        print("|---|---|---|")
        for floor, name, listed in rows:
            print(f"| {floor} | {name} | {listed} |")
    else:
        for floor, name, listed in rows:
            print(f"{floor}  {name:<13} -> {listed}")
    for b in bad:
        print(f"floors: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
