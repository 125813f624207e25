#!/usr/bin/env python3
"""Modules of a crate that import each other, directly or around a loop.

    python3 scripts/module-cycles.py copus-burn/src [more crate src dirs]

Every `.rs` file is a module (`mod.rs` and `lib.rs` name their folder). An edge A -> B is a
`use` or an inline `crate::`/`super::`/`self::` path in A that resolves to module B (to the
longest existing module prefix). Declaring a child (`mod b;`) is not an edge; using its items
is. Inline `#[cfg(test)] mod tests { .. }` blocks and comments are ignored; a `main.rs`
beside a `lib.rs` is another crate and left out. Prints every strongly connected
component of more than one module with its edges and exits 1 if there is any.
"""

import os
import re
import sys


def modules(root):
    found = {}
    library = os.path.exists(os.path.join(root, "lib.rs"))
    for folder, dirs, files in os.walk(root):
        if library and folder == root:
            # A binary beside the library is another crate root: leave it and bin/ out.
            dirs[:] = [d for d in dirs if d != "bin"]
            files = [f for f in files if f != "main.rs"]
        for name in files:
            if name.endswith(".rs"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, root)[:-3].split(os.sep)
                if parts[-1] in ("mod", "lib", "main"):
                    parts = parts[:-1]
                found[tuple(parts)] = path
    return found


def source(path):
    """The file without comments and without its inline `#[cfg(test)] mod tests { .. }`."""
    text = re.sub(r"//[^\n]*", "", open(path, encoding="utf-8").read())
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{", text)
    if m:
        depth, end = 1, m.end()
        while end < len(text) and depth:
            depth += (text[end] == "{") - (text[end] == "}")
            end += 1
        text = text[: m.start()] + text[end:]
    return text


def expand(use):
    """`a::{b, c::{d, e}}` -> [`a::b`, `a::c::d`, `a::c::e`]."""
    m = re.match(r"^(.*?)\{(.*)\}$", use)
    if not m:
        return [use]
    prefix, inner = m.groups()
    items, depth, item = [], 0, ""
    for ch in inner:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            items.append(prefix + item)
            item = ""
        else:
            item += ch
    if item:
        items.append(prefix + item)
    return [x for i in items for x in expand(i)]


def resolve(mods, current, path):
    parts = path.split("::")
    if parts[0] == "crate":
        base, parts = (), parts[1:]
    elif parts[0] in ("super", "self"):
        base = current
        while parts and parts[0] == "super":
            base, parts = base[:-1], parts[1:]
        if parts and parts[0] == "self":
            parts = parts[1:]
    elif current + (parts[0],) in mods:
        base = current
    else:
        return None
    for part in parts:
        if base + (part,) not in mods:
            break
        base = base + (part,)
    return base


def edges(mods):
    graph = {}
    for module, path in mods.items():
        text = source(path)
        targets = set()
        for use in re.findall(r"\buse\s+([^;]+);", text):
            for item in expand(re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", use))):
                target = resolve(mods, module, item)
                if target is not None:
                    targets.add(target)
        for path_ in re.findall(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+)", text):
            target = resolve(mods, module, path_)
            if target is not None:
                targets.add(target)
        # Paths through a child module without a `use` (`child::Item` in an expression).
        for child in {k[-1] for k in mods if k and k[:-1] == module}:
            if re.search(r"(?<![\w:])" + re.escape(child) + r"::\w", text):
                targets.add(module + (child,))
        targets.discard(module)
        graph[module] = targets
    return graph


def cycles(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def name(module):
    return "::".join(module) or "(crate root)"


def self_test():
    """A two-module crate whose modules import each other must be reported, and one without the
    loop must not."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "src")
        os.makedirs(src)
        with open(os.path.join(src, "lib.rs"), "w") as f:
            f.write("mod a;\nmod b;\n")
        with open(os.path.join(src, "a.rs"), "w") as f:
            f.write("use crate::b::Thing;\npub struct Other;\n")
        with open(os.path.join(src, "b.rs"), "w") as f:
            f.write("use crate::a::Other;\npub struct Thing;\n")
        looped = cycles(edges(modules(src)))
        with open(os.path.join(src, "b.rs"), "w") as f:
            f.write("pub struct Thing;\n")
        one_way = cycles(edges(modules(src)))
    if len(looped) != 1 or one_way:
        print(f"self-test failed: loop found {looped}, one-way found {one_way}")
        sys.exit(1)
    print("self-test: a loop of two modules is found, a one-way import is not")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return
    bad = 0
    for root in sys.argv[1:] or ["copus-burn/src"]:
        graph = edges(modules(root))
        if not graph:
            print(f"{root}: no modules found (no lib.rs or main.rs there?)")
            bad += 1
            continue
        for component in cycles(graph):
            bad += 1
            print(f"{root}: modules importing each other: {', '.join(sorted(map(name, component)))}")
            for a in sorted(component):
                for b in sorted(graph[a]):
                    if b in component:
                        print(f"    {name(a)} -> {name(b)}")
        print(f"{root}: {len(graph)} modules, {sum(map(len, graph.values()))} edges")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
