"""Every reference the documentation makes inside this repository resolves.

Checked in README.md, docs/*.md, deploy/*.md and client/python/README.md:

- a Markdown link to a repository path, `[text](path)` or
  `[text](path#anchor)` (relative to the page, as GitHub reads it), names a
  file or folder that exists, and its anchor is a heading of that page
  (GitHub's anchors: the heading lowercased, punctuation but `-` and `_`
  dropped, spaces turned to `-`, `-1`, `-2` ... after repeats); `(#anchor)`
  is a heading of the same page;
- a section cited by name, `docs/semantics.md, "Commit modes"` (also
  `semantics.md's "..."`, `benchmarks.md`, "..." with the file in
  backticks, [protocol.md](protocol.md), "..." after a link, and
  "..." in `benchmarks.md`), and one of the same page (see "...", as in
  "..."), names a heading of that page (the heading's text without its
  `#`s and Markdown; a citation may name the heading's start up to a colon or
  a parenthesis, or a dated heading's name after its colon);
- a path in backticks under one of the repository's top folders
  (`tools/gpu/run_suite.sh`, `docs/results/restart_h200.txt`) exists, a
  `//package:target` label's package has a BUILD file, and a folder named
  with a trailing `/` exists.

And one fact the pages state about the repository: deploy/README.md's
`specstate.v1.SpecState: N methods: ...` line (reflection_check.py's output)
names every rpc of the SpecState service in proto/specstate/v1/specstate.proto,
in order, and N is their count.

External links (http, https, mailto), paths outside the repository's
folders (vLLM's, /dev/shm/..., /tmp/...) and text inside fenced code blocks
are not references and are not checked. The test fails listing every
reference that does not resolve, with its page and line.
"""
from __future__ import annotations

import glob
import os
import re
import unittest
from typing import Dict, List, Optional, Set, Tuple

import junit_runner

_WORKSPACE = os.environ.get("TEST_WORKSPACE", "specstate")


def _root() -> str:
    """The source tree: where the README.md runfile links to under Bazel (the
    references reach every folder, more than a test's runfiles hold), else
    the checkout this file is in."""
    for base in (os.environ.get("TEST_SRCDIR"), os.environ.get("RUNFILES_DIR")):
        if base:
            readme = os.path.join(base, _WORKSPACE, "README.md")
            if os.path.exists(readme):
                return os.path.dirname(os.path.realpath(readme))
    return os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def pages(root: str) -> List[str]:
    found = ["README.md", "client/python/README.md"]
    found += sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))
    found += sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "deploy", "*.md")))
    return [p for p in found if os.path.isfile(os.path.join(root, p))]


def _without_code_blocks(text: str) -> List[Tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def heading_text(line: str) -> Optional[str]:
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
        return None
    text = m.group(1)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    return text.replace("`", "").replace("**", "").replace("*", "").strip()


def headings(text: str) -> List[str]:
    return [h for _, line in _without_code_blocks(text) for h in [heading_text(line)] if h]


def anchors(text: str) -> Set[str]:
    """GitHub's anchors for the page's headings."""
    seen: Dict[str, int] = {}
    out = set()
    for h in headings(text):
        slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _cites(heading: str, cited: str) -> bool:
    cited = cited.replace("`", "").replace("**", "").strip()
    if heading == cited:
        return True
    # "Restarts" for "Restarts: pools that outlive specstated", "Commit
    # modes" for "Commit modes (EAGER, DEFERRED, FAST)", and a dated
    # heading's name: "The service" for "2026-12-02: The service".
    return (any(heading.startswith(cited + sep) for sep in (":", " (", " -", ","))
            or heading.endswith(": " + cited))


class Checker:
    def __init__(self, root: str) -> None:
        self.root = root
        self.tops = {d for d in os.listdir(root)
                     if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")
                     and not d.startswith("bazel-")}
        self._texts: Dict[str, str] = {}
        self.page = ""

    def text(self, path: str) -> str:
        if path not in self._texts:
            with open(os.path.join(self.root, path), encoding="utf-8") as f:
                self._texts[path] = f.read()
        return self._texts[path]

    def resolve(self, page: str, target: str) -> Optional[str]:
        """`target` as the page's link or citation names it: relative to the
        page's folder, else to the checkout's top. None when neither exists."""
        for base in (os.path.dirname(page), ""):
            path = os.path.normpath(os.path.join(base, target))
            if not path.startswith("..") and os.path.exists(os.path.join(self.root, path)):
                return path
        return None

    def check(self, page: str) -> List[str]:
        self.page = page
        problems = []
        text = self.text(page)
        lines = _without_code_blocks(text)
        # Join each paragraph's lines, so a citation split over two lines is
        # read whole (reported at the paragraph's first line).
        paragraphs: List[Tuple[int, str]] = []
        for n, line in lines:
            if line.strip() and paragraphs and paragraphs[-1][1] and not heading_text(line):
                paragraphs[-1] = (paragraphs[-1][0], paragraphs[-1][1] + " " + line.strip())
            else:
                paragraphs.append((n, line.strip()))
        for n, para in paragraphs:
            where = f"{page}:{n}"
            for m in re.finditer(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)", para):
                problems += self._link(page, where, m.group(1))
            for m in re.finditer(r"(?:`?([\w./-]+\.md)`?|\[[^\]]*\]\(([\w./-]+\.md)\))"
                                 r"(?:,|'s) \"([^\"]+)\"", para):
                problems += self._citation(page, where, m.group(1) or m.group(2), m.group(3))
            for m in re.finditer(r"\"([^\"]+)\" in (?:`([\w./-]+\.md)`|([\w./-]+\.md))", para):
                problems += self._citation(page, where, m.group(2) or m.group(3), m.group(1))
            for m in re.finditer(r"(?:[Ss]ee|[Aa]s in) \"([A-Z][^\"]+)\"(?! in [`\w./-]+\.md)",
                                 para):
                problems += self._citation(page, where, page, m.group(1))
            for m in re.finditer(r"`([^`\s]+)`", para):
                problems += self._path(where, m.group(1))
        return problems

    def _link(self, page: str, where: str, target: str) -> List[str]:
        if re.match(r"^[a-z]+:", target):
            return []
        path_part, _, anchor = target.partition("#")
        if path_part:
            path = self.resolve(page, path_part)
            if path is None:
                return [f"{where}: link to {target}: no {path_part} in the repository"]
        else:
            path = page
        if anchor and path.endswith(".md") and anchor not in anchors(self.text(path)):
            return [f"{where}: link to {target}: {path} has no heading with anchor #{anchor}"]
        return []

    def _citation(self, page: str, where: str, file: str, section: str) -> List[str]:
        path = self.resolve(page, file)
        if path is None:
            # A bare page name ("semantics.md's") is the docs folder's.
            path = self.resolve("docs/x.md", file)
        if path is None:
            return [f'{where}: {file}, "{section}": no {file} in the repository']
        if not any(_cites(h, section) for h in headings(self.text(path))):
            return [f'{where}: {file}, "{section}": {path} has no such heading']
        return []

    def _path(self, where: str, token: str) -> List[str]:
        if token.startswith("//"):
            package = token[2:].split(":", 1)[0].split("/...", 1)[0]
            if package and not package.endswith("...") and \
                    not os.path.isfile(os.path.join(self.root, package, "BUILD")):
                return [f"{where}: label {token}: no package {package}"]
            return []
        path = token.rstrip(".,;:")
        if "/" not in path or path.split("/", 1)[0] not in self.tops:
            return []
        if any(c in path for c in "*?[]{}<>$=") or re.search(r"\b[A-Z]{2,}\b", path):
            return []  # a pattern or a placeholder (tools/gpu/run_suite.sh BUNDLE ...)
        if ":" in path:  # a label without its //: tests/integration:service_test
            package = path.split(":", 1)[0]
            if not os.path.isfile(os.path.join(self.root, package, "BUILD")):
                return [f"{where}: label {token}: no package {package}"]
            return []
        if self.resolve(self.page, path) is not None or self._built(path):
            return []
        return [f"{where}: `{token}`: no such file or folder in the repository"]

    def _built(self, path: str) -> bool:
        """Whether `path` is a Bazel target's output (tools/gpu/vmm_probe):
        its folder's BUILD declares a target of that name."""
        build = os.path.join(self.root, os.path.dirname(path), "BUILD")
        if not os.path.isfile(build):
            return False
        with open(build, encoding="utf-8") as f:
            return re.search(r'name = "%s"' % re.escape(os.path.basename(path)), f.read()) is not None


class DocReferencesTest(unittest.TestCase):
    def test_every_reference_resolves(self) -> None:
        root = _root()
        self.assertTrue(os.path.isfile(os.path.join(root, "WORKSPACE")), root)
        checker = Checker(root)
        checked = pages(root)
        self.assertIn("README.md", checked)
        self.assertIn("docs/protocol.md", checked)
        problems = [p for page in checked for p in checker.check(page)]
        self.assertEqual(problems, [], "references that do not resolve:\n" + "\n".join(problems))

    def test_deploy_readme_lists_every_method(self) -> None:
        root = _root()
        with open(os.path.join(root, "proto", "specstate", "v1", "specstate.proto")) as f:
            proto = f.read()
        service = re.search(r"^service SpecState \{(.*?)^\}", proto, flags=re.S | re.M)
        self.assertIsNotNone(service)
        rpcs = re.findall(r"^\s*rpc (\w+)\s*\(", service.group(1), flags=re.M)
        self.assertGreater(len(rpcs), 10)
        with open(os.path.join(root, "deploy", "README.md")) as f:
            lines = re.findall(r"specstate\.v1\.SpecState: (\d+) methods: (.*)$", f.read(), flags=re.M)
        self.assertEqual(len(lines), 1, lines)
        count, names = lines[0]
        self.assertEqual(names.split(), rpcs)
        self.assertEqual(int(count), len(rpcs))

    def test_the_checker_finds_what_does_not_resolve(self) -> None:
        # The checker against pages written here: each broken reference found,
        # each good one passed.
        import random
        import tempfile
        rng = random.Random()
        word = "".join(rng.choice("abcdefghij") for _ in range(8))
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "docs"))
            os.makedirs(os.path.join(root, "tools"))
            with open(os.path.join(root, "tools", f"{word}.sh"), "w") as f:
                f.write("")
            with open(os.path.join(root, "docs", "a.md"), "w") as f:
                f.write(f"# A\n\n## Good {word}: more\n\n## Twice\n\n## Twice\n")
            with open(os.path.join(root, "docs", "b.md"), "w") as f:
                f.write("\n".join([
                    "# B",
                    f"[ok](a.md#good-{word}-more) [ok](a.md#twice-1) [ok](#b) `tools/{word}.sh`",
                    f'docs/a.md, "Good {word}" and a.md\'s "Twice" (both fine)',
                    f"[bad](a.md#{word}) [bad](c.md) `tools/{word}x.sh`",
                    f'docs/a.md, "Bad {word}" and',
                    'docs/z.md, "Anything"',
                    f'see "Twice" in `a.md`, as in "B"; see "Nothing {word}" in a.md',
                    "```sh", "[not](checked.md) `tools/none.sh`", "```",
                ]))
            found = Checker(root).check("docs/b.md")
        self.assertEqual(len(found), 6, "\n".join(found))
        for text in (f"#{word}", "no c.md", f"tools/{word}x.sh", f'"Bad {word}"', "no docs/z.md",
                     f'"Nothing {word}"'):
            self.assertTrue(any(text in p for p in found), f"{text} not in:\n" + "\n".join(found))


if __name__ == "__main__":
    junit_runner.main()
