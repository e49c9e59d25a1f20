#!/usr/bin/env python3
"""Cargo.lock against the RustSec advisory database, offline.

`cargo audit` fetches its database from GitHub, which CI here cannot reach.
This script reads the same advisories (RustSec's TOML front matter: the
affected package, `[versions] patched` and `unaffected` requirements,
`withdrawn`, `informational`) from a snapshot committed under
`.ci/advisory-db/` — only the crates Cargo.lock names, refreshed with
`python3 .ci/audit.py --refresh PATH_TO_ADVISORY_DB_CHECKOUT` — and applies
RustSec's rule: a crate version is affected unless a `patched` or
`unaffected` requirement matches it. Vulnerabilities fail the run (exit 1)
unless listed in IGNORED below with a reason; informational advisories
(unmaintained, unsound, notice) are printed as warnings, as `cargo audit`
does by default. Yanked crates are not checked (that needs the crates.io
index).

Usage: python3 .ci/audit.py [--refresh DB]   (from the repository root)
"""
import os
import re
import shutil
import sys
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SNAPSHOT = os.path.join(HERE, "advisory-db")

# Advisory id -> why it does not apply (docs/reliability.md repeats these).
IGNORED = {}


def parse_version(v):
    """(major, minor, patch, is_release, pre) of a semver string."""
    core, _, pre = v.strip().partition("-")
    core = core.split("+")[0]
    parts = [int(p) for p in core.split(".")]
    while len(parts) < 3:
        parts.append(0)
    return (parts[0], parts[1], parts[2], 0 if pre else 1, pre)


def comparator_matches(c, v):
    """Whether version tuple `v` satisfies one comparator such as `>= 1.2.3`."""
    m = re.fullmatch(r"\s*(>=|<=|>|<|=|\^|~)?\s*([0-9][0-9A-Za-z.+-]*)\s*", c)
    if not m:
        raise ValueError(f"unreadable requirement {c!r}")
    op, text = m.group(1) or "^", m.group(2)
    given = len(text.split("-")[0].split("+")[0].split("."))
    r = parse_version(text)
    if op == ">=":
        return v >= r
    if op == ">":
        return v > r
    if op == "<=":
        return v <= r
    if op == "<":
        return v < r
    if op == "=":
        return v[:3] == r[:3] and v[3:] == r[3:]
    major, minor, patch = r[:3]
    if op == "~":
        upper = (major + 1, 0, 0) if given == 1 else (major, minor + 1, 0)
    elif major > 0 or given == 1:
        upper = (major + 1, 0, 0)
    elif minor > 0 or given == 2:
        upper = (0, minor + 1, 0)
    else:
        upper = (0, 0, patch + 1)
    return v >= r and v < (*upper, 0, "")


def requirement_matches(req, version):
    v = parse_version(version)
    return all(comparator_matches(c, v) for c in req.split(","))


def front_matter(path):
    """The advisory's TOML and its title (the first Markdown heading)."""
    text = open(path, encoding="utf-8").read()
    m = re.match(r"```toml\n(.*?)\n```", text, re.S)
    if not m:
        return None, ""
    title = re.search(r"^# (.+)$", text[m.end():], re.M)
    return tomllib.loads(m.group(1)), title.group(1).strip() if title else ""


def self_test():
    """The requirement rules on cases whose answers RustSec's docs give."""
    cases = [(">= 1.2.3", "1.2.3", True), (">= 1.2.3", "1.2.2", False), ("^0.4.5", "0.4.9", True),
             ("^0.4.5", "0.5.0", False), ("^1.2", "1.9.0", True), ("^1.2", "2.0.0", False), ("^0.0.3", "0.0.4", False),
             ("< 0.3", "0.2.9", True), ("< 0.3", "0.3.0", False), (">= 0.4.2, < 0.5", "0.4.7", True),
             (">= 0.4.2, < 0.5", "0.5.1", False), ("~1.2.3", "1.2.9", True), ("~1.2.3", "1.3.0", False),
             ("=1.0.0", "1.0.0", True), ("1.1", "1.4.2", True), (">= 1.0.0-alpha.2", "1.0.0", True)]
    for req, version, expected in cases:
        assert requirement_matches(req, version) == expected, (req, version, expected)


def lock_packages():
    lock = tomllib.load(open(os.path.join(ROOT, "Cargo.lock"), "rb"))
    return [(p["name"], p["version"]) for p in lock["package"] if p.get("source", "").startswith("registry+")]


def refresh(db):
    """Copies the advisories of the crates Cargo.lock names from a checkout."""
    names = sorted({n for n, _ in lock_packages()})
    shutil.rmtree(os.path.join(SNAPSHOT, "crates"), ignore_errors=True)
    copied = 0
    for n in names:
        src = os.path.join(db, "crates", n)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(SNAPSHOT, "crates", n))
            copied += len(os.listdir(src))
    import subprocess
    head = subprocess.run(["git", "-C", db, "log", "-1", "--format=%H (%cs)"], capture_output=True, text=True).stdout.strip()
    with open(os.path.join(SNAPSHOT, "SNAPSHOT"), "w") as f:
        f.write(f"RustSec advisory-db at {head or 'an unversioned copy'}\n")
    print(f"copied {copied} advisories for {len(names)} crates into {SNAPSHOT}")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--refresh":
        return refresh(sys.argv[2])
    self_test()
    packages = lock_packages()
    vulnerable, warnings, checked = [], [], 0
    for name, version in packages:
        folder = os.path.join(SNAPSHOT, "crates", name)
        if not os.path.isdir(folder):
            continue
        for f in sorted(os.listdir(folder)):
            fm, title = front_matter(os.path.join(folder, f))
            if fm is None:
                continue
            adv, versions = fm.get("advisory", {}), fm.get("versions", {})
            if adv.get("withdrawn"):
                continue
            checked += 1
            safe = versions.get("patched", []) + versions.get("unaffected", [])
            if any(requirement_matches(r, version) for r in safe):
                continue
            line = f"{adv.get('id')} {name} {version}: {title} (patched: {versions.get('patched', [])})"
            if adv.get("informational"):
                warnings.append(f"warning ({adv['informational']}): {line}")
            elif adv.get("id") in IGNORED:
                warnings.append(f"ignored ({IGNORED[adv['id']]}): {line}")
            else:
                vulnerable.append(line)
    stamp = open(os.path.join(SNAPSHOT, "SNAPSHOT")).read().strip()
    print(f"{len(packages)} crates from crates.io, {checked} (crate version, advisory) pairs checked ({stamp})")
    for w in warnings:
        print(w)
    for v in vulnerable:
        print(f"VULNERABLE: {v}")
    if vulnerable:
        sys.exit(1)
    print("no known vulnerability")


if __name__ == "__main__":
    main()
